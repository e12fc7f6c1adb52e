"""Tool calls and reasoning over HTTP with the official client on the tiny checkpoint: forced
calls always parse and validate, streams agree with bodies and never interleave calls, `auto`
validates what the model wrote, reasoning has its own channel, bad tool specs are 400s."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from serve_app.grammar.tools import arguments_schema

pytestmark = pytest.mark.serve

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
_CITY = {"type": "string", "minLength": 1, "maxLength": 8}
_SMALL = {"type": "integer", "minimum": 0, "maximum": 99}


def tool(name: str, parameters: dict | None = None) -> dict:
    function: dict[str, Any] = {"name": name, "description": f"{name} tool"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


# fmt: off
WEATHER = tool("get_weather", {"type": "object", "required": ["city"], "properties": {
    "city": _CITY, "unit": {"enum": ["c", "f"]}}})
ADD = tool("add", {"type": "object", "required": ["a", "b"], "properties": {
    "a": _SMALL, "b": _SMALL}})
LOOKUP = tool("lookup", {"type": "object", "required": ["query"], "properties": {
    "query": {"type": "object", "required": ["terms"], "properties": {
        "terms": {"type": "array", "items": {"type": "string", "maxLength": 5},
                  "minItems": 1, "maxItems": 2},
        "exact": {"type": "boolean"}}}}})
FLAGS = tool("set_flags", {"type": "object", "required": ["on"], "properties": {
    "on": {"type": "boolean"}, "level": {"type": "number", "minimum": -1, "maximum": 1},
    "mode": {"anyOf": [{"type": "null"}, {"enum": ["fast", "slow"]}]}}})
PING = tool("ping")  # no parameters: the arguments are {}
# fmt: on
TOOLSETS = [[WEATHER, PING], [ADD, LOOKUP], [FLAGS, WEATHER, ADD]]
SEEDS = range(8)


def schema_of(tools: list[dict], name: str) -> dict:
    function = next(t["function"] for t in tools if t["function"]["name"] == name)
    return arguments_schema(function.get("parameters"))


def create(client: openai.OpenAI, model_id: str, **kwargs: Any):
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", 160)
    return client.chat.completions.create(model=model_id, **kwargs)


def assert_valid_calls(tools: list[dict], calls: list) -> None:
    assert calls, "a forced tool_choice returned no call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)  # a JSON string, always parseable
        jsonschema.validate(arguments, schema_of(tools, call.function.name))


def stream_events(client: openai.OpenAI, model_id: str, **kwargs: Any) -> dict[str, Any]:
    """Read a stream, checking the tool-call order contract as it arrives."""
    calls: list[dict[str, Any]] = []
    content, reasoning, finishes = "", "", []
    for chunk in create(client, model_id, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for tc in delta.tool_calls or []:
                if tc.index == len(calls):  # a new call: id, type and the whole name first
                    assert tc.id and tc.type == "function" and tc.function.name
                    calls.append({"id": tc.id, "name": tc.function.name, "arguments": ""})
                else:  # never a return to an earlier call, never a name again
                    assert tc.index == len(calls) - 1, "tool calls interleaved"
                    assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert len(finishes) == 1, finishes
    return {"calls": calls, "content": content, "reasoning": reasoning, "finish": finishes[0]}


def run_all(fn, cases: list) -> list:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(fn, cases))


# --------------------------------------------------------------------- forced calls


@pytest.mark.parametrize("toolset", range(len(TOOLSETS)))
def test_required_calls_always_parse_and_validate(client, model_id, toolset):
    tools = TOOLSETS[toolset]

    def one(seed: int):
        return create(
            client,
            model_id,
            tools=tools,
            tool_choice="required",
            seed=seed,
            parallel_tool_calls=False,
        )

    for response in run_all(one, list(SEEDS)):
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1  # parallel_tool_calls: false
        assert_valid_calls(tools, choice.message.tool_calls)
        assert choice.message.content is None  # nothing but the call


def test_named_function_is_the_only_call(client, model_id):
    tools = [WEATHER, ADD, PING]
    named = {"type": "function", "function": {"name": "add"}}

    def one(seed: int):
        return create(client, model_id, tools=tools, tool_choice=named, seed=seed)

    for response in run_all(one, list(SEEDS)):
        calls = response.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["add"]
        assert_valid_calls(tools, calls)


def test_streamed_calls_equal_the_non_streamed_calls(client, model_id):
    tools = [WEATHER, ADD, PING]

    def both(seed: int):
        kwargs = dict(tools=tools, tool_choice="required", seed=seed, max_tokens=200)
        return create(client, model_id, **kwargs), stream_events(client, model_id, **kwargs)

    for body, streamed in run_all(both, list(SEEDS)):
        choice = body.choices[0]
        assert streamed["finish"] == choice.finish_reason
        if choice.finish_reason != "tool_calls":
            continue  # cut by max_tokens: the body leaves the partial call out
        got = [(c["name"], c["arguments"]) for c in streamed["calls"]]
        assert got == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert len({c["id"] for c in streamed["calls"]}) == len(got)  # ids are unique


def test_parallel_calls_stream_one_after_another(client, model_id):
    tools = [WEATHER, PING, ADD]

    def one(seed: int):
        return seed, stream_events(
            client, model_id, tools=tools, tool_choice="required", seed=seed, max_tokens=240
        )

    parallel = [(s, r) for s, r in run_all(one, list(range(16))) if len(r["calls"]) >= 2]
    assert parallel, "no seed produced two calls: the grammar must allow several"
    for _, streamed in parallel:
        complete = streamed["calls"] if streamed["finish"] == "tool_calls" else []
        for call in complete:  # joined fragments of every call are its whole arguments
            jsonschema.validate(json.loads(call["arguments"]), schema_of(tools, call["name"]))


# ------------------------------------------------------------------------- auto


def forced_text(text: str) -> dict:
    """Make the tiny model write exactly `text` (a one-element choice grammar)."""
    return {"structured_outputs": {"choice": [text]}}


GOOD_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
BAD_CALLS = [
    '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',  # unknown tool
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',  # not JSON
    '<tool_call>\n{"name": "get_weather"}\n</tool_call>',  # no arguments
]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_returns_a_well_formed_call(client, model_id, stream):
    kwargs = dict(tools=[WEATHER], extra_body=forced_text("Let me look. " + GOOD_CALL))
    if stream:
        got = stream_events(client, model_id, **kwargs)
        calls, content, finish = got["calls"], got["content"], got["finish"]
        calls = [(c["name"], c["arguments"]) for c in calls]
    else:
        choice = create(client, model_id, **kwargs).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        content, finish = choice.message.content, choice.finish_reason
    assert calls == [("get_weather", '{"city": "Oslo"}')]
    assert content == "Let me look."  # text outside the tags stays content
    assert finish == "tool_calls"


@pytest.mark.parametrize("text", BAD_CALLS)
def test_auto_returns_a_malformed_call_as_content(client, model_id, text):
    kwargs = dict(tools=[WEATHER], tool_choice="auto", extra_body=forced_text(text))
    choice = create(client, model_id, **kwargs).choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content == text and choice.finish_reason == "stop"
    streamed = stream_events(client, model_id, **kwargs)
    assert streamed["calls"] == [] and streamed["content"] == text


def test_a_replayed_stream_carries_the_same_calls_and_reasoning(client, model_id):
    text = "<think>which city</think>\n\nChecking. " + GOOD_CALL
    headers = {"X-Request-Id": f"tools-{uuid.uuid4().hex}"}
    kwargs = dict(tools=[WEATHER], extra_body=forced_text(text), extra_headers=headers)
    first = stream_events(client, model_id, **kwargs)
    assert first["reasoning"] == "which city" and len(first["calls"]) == 1
    assert stream_events(client, model_id, **kwargs) == first  # recorded, not generated again


def test_tool_choice_none_reads_no_calls(client, model_id):
    kwargs = dict(tools=[WEATHER], tool_choice="none", extra_body=forced_text(GOOD_CALL))
    choice = create(client, model_id, **kwargs).choices[0]
    assert choice.message.tool_calls is None and choice.message.content == GOOD_CALL


# -------------------------------------------------------------------- reasoning

THOUGHT = "<think>\nFirst, the city. 天気 ✓\n</think>\n\nIt is sunny."


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_has_its_own_channel(client, model_id, stream):
    kwargs = dict(extra_body=forced_text(THOUGHT))
    if stream:
        got = stream_events(client, model_id, **kwargs)
        reasoning, content = got["reasoning"], got["content"]
    else:
        message = create(client, model_id, **kwargs).choices[0].message
        reasoning, content = message.reasoning_content, message.content
    assert reasoning == "First, the city. 天気 ✓"
    assert content == "It is sunny."


def test_logprobs_cover_reasoning_and_call_tokens(client, model_id):
    text = "<think>hm</think>\n\n" + GOOD_CALL
    kwargs = dict(tools=[WEATHER], logprobs=True, extra_body=forced_text(text))

    def without_stop(tokens: list[str]) -> str:
        assert tokens[-1] in ("<|im_end|>", "</s>")  # the stop token has a logprob too
        return "".join(tokens[:-1])

    choice = create(client, model_id, **kwargs).choices[0]
    assert without_stop([t.token for t in choice.logprobs.content]) == text
    streamed = []
    for chunk in create(client, model_id, stream=True, **kwargs):
        for c in chunk.choices:
            streamed += [t.token for t in (c.logprobs.content if c.logprobs else None) or []]
    assert without_stop(streamed) == text


def test_each_choice_reads_its_own_calls(client, model_id):
    tools = [WEATHER, ADD]
    response = create(client, model_id, tools=tools, tool_choice="required", n=3, seed=5)
    assert len(response.choices) == 3
    for choice in response.choices:
        if choice.finish_reason == "tool_calls":
            assert_valid_calls(tools, choice.message.tool_calls)
        else:  # cut by max_tokens after some complete calls
            assert choice.finish_reason == "length"


def test_reasoning_switch_off_keeps_the_text_verbatim(client, model_id):
    body = forced_text(THOUGHT) | {"chat_template_kwargs": {"enable_thinking": False}}
    message = create(client, model_id, extra_body=body).choices[0].message
    assert message.content == THOUGHT
    assert getattr(message, "reasoning_content", None) is None


def test_reasoning_then_a_call(client, model_id):
    text = "<think>need weather</think>\n\n" + GOOD_CALL
    kwargs = dict(tools=[WEATHER], extra_body=forced_text(text))
    choice = create(client, model_id, **kwargs).choices[0]
    assert choice.message.reasoning_content == "need weather"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    streamed = stream_events(client, model_id, **kwargs)
    assert streamed["reasoning"] == "need weather" and len(streamed["calls"]) == 1


SCHEMA = {"type": "object", "required": ["n"], "properties": {"n": _SMALL}}


def test_structured_output_applies_after_the_reasoning_span(client, model_id):
    def one(seed: int):
        return create(
            client,
            model_id,
            seed=seed,
            max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        ).choices[0]

    finished = [c for c in run_all(one, list(range(12))) if c.finish_reason == "stop"]
    assert finished, "no seed finished its answer"
    for choice in finished:  # thinking or not, the content is the constrained answer
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_forced_call_after_reasoning(client, model_id):
    def one(seed: int):
        return create(
            client,
            model_id,
            seed=seed,
            max_tokens=160,
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        ).choices[0]

    choices = run_all(one, list(range(16)))
    called = [c for c in choices if c.finish_reason == "tool_calls"]
    assert called, "no seed reached its call"
    for choice in called:
        assert_valid_calls([WEATHER], choice.message.tool_calls)
    for choice in choices:  # the rest is still thinking when max_tokens cuts it
        assert choice.finish_reason == "tool_calls" or choice.message.reasoning_content


# ----------------------------------------------------------------- history, errors


def test_a_history_with_tool_results_renders_and_generates(client, model_id):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear", "c": 21}'},
    ]
    with_result = create(client, model_id, messages=history, tools=[WEATHER], max_tokens=8, seed=0)
    without = create(client, model_id, tools=[WEATHER], max_tokens=8, seed=0)
    assert with_result.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert with_result.usage.prompt_tokens > without.usage.prompt_tokens + 10


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
ERRORS = [
    ({"tools": []}, "invalid_request", "tools"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "invalid_request",
        "tool_choice.function.name",
    ),
    ({"tool_choice": "required"}, "invalid_request", "tool_choice"),
    (
        {"tool_choice": {"type": "function", "function": {"name": "add"}}},
        "invalid_request",
        "tool_choice",
    ),
    ({"tools": [tool("bad", BAD_SCHEMA)]}, "invalid_grammar", "tools.0.function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "invalid_request", "tools.1.function.name"),
    (
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "invalid_request",
        "tool_choice",
    ),
    (
        {"tools": [WEATHER], "tool_choice": "required", "strict_thinking": True},
        "unsupported_parameter",
        "strict_thinking",
    ),
    ({"strict_thinking": True}, "invalid_request", "strict_thinking"),
]


@pytest.mark.parametrize(("extra", "code", "param"), ERRORS)
def test_bad_tool_requests_are_400_naming_the_field(serve_url, model_id, extra, code, param):
    body = {"model": model_id, "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(f"{serve_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (code, param)
    assert r.headers["x-should-retry"] == "false"


def test_server_info_names_the_parsers(serve_url):
    info = httpx.get(f"{serve_url}/v1/server_info", timeout=30).json()["tool_calling"]
    assert info["parsers"]["hermes"] == info["parsers"][info["parser"]]
    assert info["reasoning_parser"] == {"name": "think", "version": "1"}
    assert info["tools_executed"] is False
