"""The outcome vocabulary on the OpenAI endpoints, one case per row of the outcome table
(serve_app/outcomes.py) that a client can observe: a matched stop, the grammar's own end
(constructed on purpose), max tokens and a deadline. Each of `n` constrained samples has its own
matcher: every output's token ids (`return_token_ids`) replay through a fresh xgrammar matcher,
token by token. The other families: tests/generations/test_outcomes_generations.py,
tests/batch/test_outcomes_batch.py."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import pytest
from transformers import AutoTokenizer

from tests.support.grammar import accepts_tokens, compile_spec

pytestmark = pytest.mark.serve

OUTCOME_CASES = {
    # cause: (extra request fields, finish_reason, stop_reason)
    "EOS or stop token/string": ({"stop": [" "], "max_tokens": 200}, "stop", " "),
    "grammar complete, no continuation but the end": (
        # Every choice ends within a few tokens; min_tokens forbids ending there, so the
        # grammar admits nothing more: the grammar's own end, not an error.
        {"structured_outputs": {"choice": ["yes", "no"]}, "min_tokens": 30, "max_tokens": 40},
        "stop",
        "grammar_end",
    ),
    "max tokens": ({"max_tokens": 3, "ignore_eos": True}, "length", None),
    # Far more tokens than the deadline allows (1,000 tokens in 0.2 s is 5,000 tokens/s,
    # several times what one stream of the tiny model makes on a fast machine).
    "deadline reached while running": (
        {"max_tokens": 1000, "ignore_eos": True, "timeout": 0.2},
        "timeout",
        None,
    ),
}


def completion(serve_url: str, model_id: str, **fields) -> dict:
    body = {"model": model_id, "prompt": "Tell me about the weather", "temperature": 1.0}
    r = httpx.post(f"{serve_url}/v1/completions", json={**body, "seed": 1, **fields}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("cause", list(OUTCOME_CASES))
def test_each_outcome_row_on_the_openai_endpoints(serve_url, model_id, cause):
    fields, finish_reason, stop_reason = OUTCOME_CASES[cause]
    choice = completion(serve_url, model_id, **fields)["choices"][0]
    assert choice["finish_reason"] == finish_reason, choice
    assert choice.get("stop_reason") == stop_reason, choice
    if stop_reason == "grammar_end":
        assert choice["text"] in ("yes", "no")  # the valid text, nothing invented


def test_each_sample_has_its_own_matcher_and_replays_through_a_fresh_one(
    serve_url, model_id, model_path, service, engine_cache
):
    # The integer is bounded so that every sample of the random model reaches the grammar's
    # end well within max_tokens (an unbounded one can draw digits until the length cut).
    schema = {
        "type": "object",
        "properties": {
            "w": {"enum": ["sun", "rain", "snow"]},
            "t": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["w", "t"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}}
    body = completion(
        serve_url, model_id, n=4, max_tokens=60, response_format=fmt, return_token_ids=True
    )
    payload = compile_spec(service, "json_schema", json.dumps(schema))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    texts = [c["text"] for c in body["choices"]]
    assert len(texts) == 4
    for c in body["choices"]:
        assert c["finish_reason"] == "stop", c
        value = json.loads(c["text"])
        jsonschema.validate(value, schema)
        assert list(value) == ["w", "t"]  # the schema's property order, not sorted keys
        # The ids are the text's (the end token, kept in the ids, decodes to nothing)...
        assert tokenizer.decode(c["token_ids"], skip_special_tokens=True) == c["text"]
        # ...and a fresh matcher takes every one of them in turn, then is at its end.
        assert accepts_tokens(engine_cache, payload, c["token_ids"]), c["token_ids"]
    # Independent samples, not one matcher's path repeated four times.
    assert len(set(texts)) > 1, texts


def test_the_grammar_end_is_counted_apart_from_invalid_grammar(serve_url, model_id, ray_session):
    fields, _, _ = OUTCOME_CASES["grammar complete, no continuation but the end"]
    completion(serve_url, model_id, **fields)
    bad = {"structured_outputs": {"regex": "[unclosed"}, "max_tokens": 4}
    r = httpx.post(
        f"{serve_url}/v1/completions",
        json={"model": model_id, "prompt": "x", **bad},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_grammar"
    node = ray_session._private.worker.global_worker.node
    url = f"http://127.0.0.1:{node.metrics_export_port}/metrics"
    wanted = ['outcome="stop"', 'code="grammar_end"', 'code="invalid_grammar"']
    deadline = time.monotonic() + 60
    while True:
        lines = [
            line
            for line in httpx.get(url, timeout=10).text.splitlines()
            if "serve_app_requests_total{" in line
        ]
        ends = [line for line in lines if 'code="grammar_end"' in line]
        errors = [line for line in lines if 'code="invalid_grammar"' in line]
        if ends and errors:
            break
        assert time.monotonic() < deadline, f"never exported: {wanted}"
        time.sleep(1)
    assert all('outcome="stop"' in line for line in ends)
    assert all('outcome="error"' in line for line in errors)
