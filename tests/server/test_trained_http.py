"""The trained demo model served as `make serve` serves it (`--model FILE.gguf` with the shipped
tool-capable template), checked as a user would: answers in English, schemas filled sensibly,
seeded samples, stop strings, a forced tool call, and the served identity naming the GGUF. (A
template that cannot render tools refuses `tools`: tests/checkpoints/test_trained_model.py.)"""

from __future__ import annotations

import hashlib
import json

import httpx
import jsonschema
import openai
import pytest

from serve_app.checkpoints.chat_templates import shipped_template_path
from serve_app.checkpoints.identity import weights_hash
from tests.support.side_apps import side_app, side_config

pytestmark = [pytest.mark.trained, pytest.mark.serve, pytest.mark.ray, pytest.mark.timeout(600)]

PARIS = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
        },
    },
}
TEMPLATE = shipped_template_path("smollm2_tools.jinja")


@pytest.fixture(scope="module")
def demo(serve_url, ray_session, trained_gguf, tmp_path_factory) -> str:
    config = side_config(
        trained_gguf,
        None,  # the GGUF file's stem
        tmp_path_factory.mktemp("trained-data"),
        engine={"kv_cache_bytes": 64 * 1024**2},
        chat_template=str(TEMPLATE),
    )
    with side_app(config, "serve-app-trained", "/trained", serve_url, ray_session) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(demo) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{demo}/v1", api_key="unused", max_retries=0)


MODEL = "SmolLM2-135M-Instruct.Q4_1"


def _chat(client, messages=PARIS, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 32)
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def test_server_info_names_the_gguf_and_the_template(demo, trained_gguf, trained_dir):
    info = httpx.get(f"{demo}/v1/server_info", timeout=30).json()
    artifact = info["artifact"]
    assert info["model"] == MODEL
    assert artifact["gguf_sha256"] == hashlib.sha256(trained_gguf.read_bytes()).hexdigest()
    assert artifact["gguf_quant_type"] == "Q4_1"
    # The dequantized weights have their own hash, and the template is the file's.
    assert artifact["weights_sha256"] == weights_hash(trained_dir)
    assert artifact["chat_template_sha256"] == hashlib.sha256(TEMPLATE.read_bytes()).hexdigest()
    assert artifact["chat_template_source"] == "smollm2_tools.jinja"
    assert info["tool_calling"]["chat_template_renders_tools"] is True


def test_the_capital_of_france_is_paris(client):
    answer = _chat(client).choices[0]
    assert "Paris" in answer.message.content
    assert answer.finish_reason == "stop"


def test_a_schema_is_filled_with_sensible_values(client):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "country": {"type": "string", "maxLength": 30},
        },
        "required": ["city", "country"],
    }
    reply = _chat(
        client,
        [{"role": "user", "content": "Paris: give its city and country as JSON."}],
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
    )
    value = json.loads(reply.choices[0].message.content)
    jsonschema.validate(value, schema)
    # The model's own casing varies ("France", "FRANCE"); the facts may not.
    assert "paris" in value["city"].lower() and "france" in value["country"].lower(), value


def test_seeded_samples_differ_and_reproduce(client):
    def sample() -> list[str]:
        reply = _chat(client, n=4, temperature=1.0, seed=11, max_tokens=12)
        return [c.message.content for c in reply.choices]

    first = sample()
    assert len(set(first)) == 4, first
    assert sample() == first


def test_stop_ends_the_answer_before_the_stop_text(client):
    answer = _chat(client, stop=["."]).choices[0]
    assert answer.finish_reason == "stop"
    assert "Paris" in answer.message.content and "." not in answer.message.content


def test_a_forced_tool_call_has_plausible_arguments(client):
    reply = _chat(
        client,
        [{"role": "user", "content": "What is the weather like in Paris right now?"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40,
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert "Paris" in json.loads(call.function.arguments)["city"]
