from __future__ import annotations

import json
from typing import Any

import pytest

from serve_app.errors import APIError
from serve_app.grammar.spec import GrammarSpec
from serve_app.protocol import ChatCompletionRequest, CompletionRequest, parse_request

DROP = object()
USER = {"role": "user", "content": "hi"}
FUNCTION = {"name": "f", "arguments": "{}"}


def body(kind: str, **changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": "m"}
    base.update({"messages": [dict(USER)]} if kind == "chat" else {"prompt": "hi"})
    for key, value in changes.items():
        if value is DROP:
            base.pop(key, None)
        else:
            base[key] = value
    return base


def rejects(kind: str, data: dict[str, Any] | bytes) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(kind, data)  # type: ignore[arg-type]
    assert info.value.status == 400
    return info.value


# ------------------------------------------------------------------ happy paths


def test_chat_minimal_and_full() -> None:
    req = parse_request("chat", json.dumps(body("chat")).encode())
    assert isinstance(req, ChatCompletionRequest)
    assert req.messages[0].text == "hi" and req.wants_generation_prompt
    full = body(
        "chat",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "developer", "content": [{"type": "text", "text": t} for t in "ab"]},
            {"role": "user", "content": "q", "name": "ann"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": FUNCTION}],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
            {"role": "assistant", "content": "so", "reasoning_content": None},
        ],
        n=2, max_completion_tokens=7, temperature=0, top_p=0.5, top_k=5, min_p=0.1,
        presence_penalty=1, frequency_penalty=-1, repetition_penalty=1.1, seed=3,
        stop=["x"], stop_token_ids=[2], include_stop_str_in_output=True, ignore_eos=False,
        min_tokens=1, logprobs=True, top_logprobs=2, stream=True,
        stream_options={"include_usage": True}, response_format={"type": "json_object"},
        chat_template_kwargs={"enable_thinking": False}, add_generation_prompt=False,
        continue_final_message=True, timeout=2.5,
    )  # fmt: skip
    req = parse_request("chat", full)
    assert req.messages[1].text == "a\nb"
    assert req.include_usage and not req.wants_generation_prompt
    assert req.chat_template_kwargs == {"enable_thinking": False}


def test_completion_prompt_forms() -> None:
    for prompt, expected in [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 0], [[1, 2, 0]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ]:
        req = parse_request("completion", body("completion", prompt=prompt))
        assert isinstance(req, CompletionRequest)
        assert req.prompts() == expected


# ------------------------------------------------------------ validation table

TOOL = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
ASSISTANT_LAST = [dict(USER), {"role": "assistant", "content": "par"}]

IR, UP, UK, IG = "invalid_request", "unsupported_parameter", "unknown_parameter", "invalid_grammar"
TEXT_PART = {"type": "text", "text": "x"}
JS = "json_schema"

# (kind, changes, code, param)
REJECTED: list[tuple[str, dict[str, Any], str, str | None]] = [
    # unknown fields, top level and nested
    ("chat", {"foo": 1}, UK, "foo"),
    ("chat", {"messages": [{**USER, "foo": 1}]}, UK, "messages.0.foo"),
    ("chat", {"messages": [{"role": "user", "content": [{**TEXT_PART, "cache_control": {}}]}]},
     UK, "messages.0.content.0.cache_control"),
    ("chat", {"stream": True, "stream_options": {"include_usage": True, "x": 1}},
     UK, "stream_options.x"),
    ("chat", {"structured_outputs": {"xml": "a"}}, UK, "structured_outputs.xml"),
    ("chat", {"guided_json": {}}, UK, "guided_json"),
    ("completion", {"max_completion_tokens": 5}, UK, "max_completion_tokens"),
    ("completion", {"top_logprobs": 2}, UK, "top_logprobs"),
    # known OpenAI fields that would change the output
    ("chat", {"logit_bias": {"5": -100}}, UP, "logit_bias"),
    ("completion", {"tools": TOOL}, UP, "tools"),
    ("completion", {"tool_choice": "required"}, UP, "tool_choice"),
    # tool requests the chat endpoint cannot mean (tests/openai/test_openai_tools.py has the rest)
    ("chat", {"tools": []}, IR, "tools"),
    ("chat", {"tool_choice": "required"}, IR, "tool_choice"),
    ("chat", {"functions": TOOL}, UP, "functions"),
    ("chat", {"function_call": "auto"}, UP, "function_call"),
    ("chat", {"audio": {"voice": "x"}}, UP, "audio"),
    ("chat", {"modalities": ["text", "audio"]}, UP, "modalities"),
    ("chat", {"prediction": {"type": "content"}}, UP, "prediction"),
    ("chat", {"web_search_options": {"a": 1}}, UP, "web_search_options"),
    ("chat", {"reasoning_effort": "low"}, UP, "reasoning_effort"),
    ("chat", {"best_of": 2}, UP, "best_of"),
    ("chat", {"echo": True}, UP, "echo"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     UP, "messages.0.content.0"),
    ("completion", {"suffix": "x"}, UP, "suffix"),
    ("completion", {"best_of": 3, "n": 2}, UP, "best_of"),
    # messages
    ("chat", {"messages": []}, IR, "messages"),
    ("chat", {"messages": "hi"}, IR, "messages"),
    ("chat", {"messages": [{"role": "bot", "content": "x"}]}, IR, "messages.0.role"),
    ("chat", {"messages": [{"role": "user"}]}, IR, "messages.0"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, IR, "messages.0.content"),
    ("chat", {"messages": [{"role": "tool", "content": "x"}]}, IR, "messages.0"),
    ("chat", {"messages": [{**USER, "tool_call_id": "c"}]}, IR, "messages.0"),
    ("chat", {"model": DROP}, IR, "model"),
    ("chat", {"model": ""}, IR, "model"),
    # sampling ranges and types (strict: no strings for numbers, no bools for ints)
    ("chat", {"n": 0}, IR, "n"),
    ("chat", {"n": 17}, IR, "n"),
    ("chat", {"n": "2"}, IR, "n"),
    ("chat", {"n": True}, IR, "n"),
    ("chat", {"max_tokens": 0}, IR, "max_tokens"),
    ("chat", {"max_completion_tokens": 0}, IR, "max_completion_tokens"),
    ("chat", {"max_tokens": 5, "max_completion_tokens": 6}, IR, "max_completion_tokens"),
    ("chat", {"temperature": -0.1}, IR, "temperature"),
    ("chat", {"temperature": 2.5}, IR, "temperature"),
    ("chat", {"temperature": "1"}, IR, "temperature"),
    ("chat", {"temperature": float("nan")}, IR, "temperature"),
    ("chat", {"top_p": 0}, IR, "top_p"),
    ("chat", {"top_p": 1.5}, IR, "top_p"),
    ("chat", {"top_k": -2}, IR, "top_k"),
    ("chat", {"top_k": 1.5}, IR, "top_k"),
    ("chat", {"min_p": 1.5}, IR, "min_p"),
    ("chat", {"presence_penalty": 2.5}, IR, "presence_penalty"),
    ("chat", {"frequency_penalty": -3}, IR, "frequency_penalty"),
    ("chat", {"repetition_penalty": 0}, IR, "repetition_penalty"),
    ("chat", {"seed": -1}, IR, "seed"),
    ("chat", {"seed": 2**63}, IR, "seed"),
    ("chat", {"min_tokens": -1}, IR, "min_tokens"),
    ("chat", {"min_tokens": 10, "max_tokens": 5}, IR, "min_tokens"),
    ("chat", {"timeout": 0}, IR, "timeout"),
    ("chat", {"ignore_eos": 1}, IR, "ignore_eos"),
    ("chat", {"include_stop_str_in_output": "yes"}, IR, "include_stop_str_in_output"),
    # stop
    ("chat", {"stop": 5}, IR, "stop"),
    ("chat", {"stop": [""]}, IR, "stop"),
    ("chat", {"stop": ""}, IR, "stop"),
    ("chat", {"stop": ["a"] * 17}, IR, "stop"),
    ("chat", {"stop": "x" * 257}, IR, "stop"),
    ("chat", {"stop": [1]}, IR, "stop.0"),
    ("chat", {"stop_token_ids": [-1]}, IR, "stop_token_ids"),
    ("chat", {"stop_token_ids": ["a"]}, IR, "stop_token_ids.0"),
    # logprobs
    ("chat", {"logprobs": 1}, IR, "logprobs"),
    ("chat", {"top_logprobs": 3}, IR, "top_logprobs"),
    ("chat", {"top_logprobs": 3, "logprobs": False}, IR, "top_logprobs"),
    ("chat", {"top_logprobs": 21, "logprobs": True}, IR, "top_logprobs"),
    ("completion", {"logprobs": 6}, IR, "logprobs"),
    ("completion", {"logprobs": True}, IR, "logprobs"),
    ("chat", {"prompt_logprobs": -1}, IR, "prompt_logprobs"),
    ("chat", {"prompt_logprobs": 21}, IR, "prompt_logprobs"),
    ("completion", {"prompt_logprobs": -1}, IR, "prompt_logprobs"),
    ("completion", {"prompt_logprobs": 21}, IR, "prompt_logprobs"),
    ("completion", {"prompt_logprobs": True}, IR, "prompt_logprobs"),
    ("completion", {"prompt_logprobs": 1.0}, IR, "prompt_logprobs"),
    ("chat", {"prompt_logprobs": 0, "stream": True}, IR, "prompt_logprobs"),
    ("completion", {"prompt_logprobs": 2, "stream": True}, IR, "prompt_logprobs"),
    # streaming
    ("chat", {"stream": "true"}, IR, "stream"),
    ("chat", {"stream_options": {"include_usage": True}}, IR, "stream_options"),
    ("chat", {"stream": False, "stream_options": {}}, IR, "stream_options"),
    # structured output
    ("chat", {"response_format": {"type": "xml"}}, IR, "response_format.type"),
    ("chat", {"response_format": {"type": "json_schema"}}, IR, "response_format"),
    ("chat", {"response_format": {"type": "text", "json_schema": {"name": "a", "schema": {}}}},
     IR, "response_format"),
    ("chat", {"response_format": {"type": JS, JS: {"name": "a b", "schema": {}}}},
     IR, "response_format.json_schema.name"),
    ("chat", {"response_format": {"type": JS, JS: {"name": "a"}}},
     IR, "response_format.json_schema.schema"),
    ("chat", {"structured_outputs": {}}, IR, "structured_outputs"),
    ("chat", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, IR, "structured_outputs"),
    ("chat", {"structured_outputs": {"regex": ""}}, IR, "structured_outputs.regex"),
    ("chat", {"structured_outputs": {"choice": []}}, IR, "structured_outputs.choice"),
    ("chat", {"structured_outputs": {"json": "{bad"}}, IG, "structured_outputs.json"),
    ("chat", {"structured_outputs": {"json": "[1]"}}, IG, "structured_outputs.json"),
    ("chat", {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     IR, "structured_outputs"),
    # chat templating
    ("chat", {"chat_template_kwargs": "x"}, IR, "chat_template_kwargs"),
    ("chat", {"messages": ASSISTANT_LAST, "continue_final_message": True,
              "add_generation_prompt": True}, IR, "continue_final_message"),
    ("chat", {"continue_final_message": True}, IR, "messages"),
    # completions prompt
    ("completion", {"prompt": DROP}, IR, "prompt"),
    ("completion", {"prompt": ""}, IR, "prompt"),
    ("completion", {"prompt": []}, IR, "prompt"),
    ("completion", {"prompt": [[]]}, IR, "prompt"),
    ("completion", {"prompt": ["a", ""]}, IR, "prompt"),
    ("completion", {"prompt": [-1]}, IR, "prompt"),
    ("completion", {"prompt": [[1, -2]]}, IR, "prompt"),
    ("completion", {"prompt": [True]}, IR, "prompt.0"),
    ("completion", {"prompt": ["a"] * 33}, IR, "prompt"),
    ("completion", {"prompt": 5}, IR, "prompt"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "changes", "code", "param"), REJECTED)
def test_rejected(kind: str, changes: dict[str, Any], code: str, param: str | None) -> None:
    err = rejects(kind, body(kind, **changes))
    assert (err.code, err.param) == (code, param), err.message
    assert err.headers["x-should-retry"] == "false"
    if param is not None and code == "invalid_request":
        assert f"'{param}'" in err.message


@pytest.mark.parametrize(
    "raw", [b"{", b'{"model": NaN}', b'{"temperature": Infinity}', b"[1]", b"\xff", b""]
)
def test_malformed_body(raw: bytes) -> None:
    err = rejects("chat", raw)
    assert (err.code, err.param) == ("invalid_request", None)


ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    # ignored: they change nothing here
    ("chat", {"user": "u1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto"}),
    ("completion", {"user": "u1", "service_tier": "default"}),
    # unsupported fields holding values that change nothing
    ("chat", {"tool_choice": "none", "parallel_tool_calls": True}),
    ("chat", {"tool_choice": "auto", "logit_bias": {}, "functions": None}),
    ("chat", {"modalities": ["text"], "echo": False, "best_of": 1}),
    ("completion", {"suffix": "", "best_of": 2, "n": 2, "echo": True}),
    # null means "not given"
    ("chat", {"temperature": None, "stop": None, "seed": None, "n": None, "response_format": None}),
]


@pytest.mark.parametrize(("kind", "changes"), ACCEPTED)
def test_accepted(kind: str, changes: dict[str, Any]) -> None:
    req = parse_request(kind, body(kind, **changes))  # type: ignore[call-overload]
    for name in ("user", "metadata", "store", "service_tier", "logit_bias", "suffix"):
        assert not hasattr(req, name)


def test_validation_runs_without_parse_request_too() -> None:
    with pytest.raises(APIError) as info:
        ChatCompletionRequest.model_validate(body("chat", logit_bias={"1": 5}))
    assert info.value.code == "unsupported_parameter"


# ------------------------------------------------------------- sampling params


def sampling(kind: str, default_max_tokens: int = 100, **changes: Any):
    return parse_request(kind, body(kind, **changes)).to_sampling_params(default_max_tokens)  # type: ignore[call-overload]


def test_defaults_follow_openai() -> None:
    sp = sampling("chat", default_max_tokens=123)
    assert (sp.n, sp.max_tokens, sp.temperature, sp.top_p, sp.top_k) == (1, 123, 1.0, 1.0, 0)
    assert (sp.stop, sp.stop_token_ids, sp.logprobs, sp.seed) == ((), (), None, None)
    assert not sp.ignore_eos and not sp.include_stop_str_in_output


def test_fields_map_onto_the_engine() -> None:
    sp = sampling(
        "chat", n=3, max_tokens=9, min_tokens=2, temperature=0.5, top_p=0.9, top_k=-1,
        min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
        seed=7, stop_token_ids=[5, 5, 6], include_stop_str_in_output=True, ignore_eos=True,
    )  # fmt: skip
    assert (sp.n, sp.max_tokens, sp.min_tokens, sp.temperature, sp.top_p) == (3, 9, 2, 0.5, 0.9)
    assert (sp.top_k, sp.min_p, sp.presence_penalty, sp.frequency_penalty) == (0, 0.05, 0.5, -0.5)
    assert (sp.repetition_penalty, sp.seed, sp.stop_token_ids) == (1.2, 7, (5, 6))
    assert sp.include_stop_str_in_output and sp.ignore_eos


@pytest.mark.parametrize(
    ("changes", "max_tokens"),
    [({}, 100), ({"max_tokens": 5}, 5), ({"max_completion_tokens": 6}, 6),
     ({"max_tokens": 7, "max_completion_tokens": 7}, 7)],
)  # fmt: skip
def test_max_tokens_precedence(changes: dict[str, Any], max_tokens: int) -> None:
    assert sampling("chat", **changes).max_tokens == max_tokens


@pytest.mark.parametrize(
    ("kind", "changes", "logprobs"),
    [("chat", {}, None), ("chat", {"logprobs": False}, None), ("chat", {"logprobs": True}, 0),
     ("chat", {"logprobs": True, "top_logprobs": 5}, 5), ("completion", {}, None),
     ("completion", {"logprobs": 0}, 0), ("completion", {"logprobs": 3}, 3)],
)  # fmt: skip
def test_logprobs_mapping(kind: str, changes: dict[str, Any], logprobs: int | None) -> None:
    assert sampling(kind, **changes).logprobs == logprobs


@pytest.mark.parametrize(
    ("kind", "changes", "prompt_logprobs"),
    [("chat", {}, None), ("chat", {"prompt_logprobs": 0}, 0), ("completion", {}, None),
     ("completion", {"prompt_logprobs": 4}, 4), ("completion", {"echo": True}, None),
     ("completion", {"logprobs": 2}, None), ("completion", {"echo": True, "logprobs": 2}, 2),
     ("completion", {"echo": True, "logprobs": 0}, 0),
     ("completion", {"echo": True, "logprobs": 2, "prompt_logprobs": 7}, 7),
     ("completion", {"echo": True, "logprobs": 3, "prompt_logprobs": 1}, 3)],
)  # fmt: skip
def test_prompt_logprobs_mapping(
    kind: str, changes: dict[str, Any], prompt_logprobs: int | None
) -> None:
    """The engine computes the larger top-k that `prompt_logprobs` and an echo ask for."""
    assert sampling(kind, **changes).prompt_logprobs == prompt_logprobs


@pytest.mark.parametrize(
    ("stop", "expected"),
    [(None, ()), ("x", ("x",)), (["a", "b", "a"], ("a", "b")), ([], ())],
)
def test_stop_normalisation(stop: Any, expected: tuple[str, ...]) -> None:
    assert sampling("completion", stop=stop).stop == expected


def test_min_tokens_above_the_default_budget_names_min_tokens() -> None:
    req = parse_request("chat", body("chat", min_tokens=50))
    with pytest.raises(APIError) as info:
        req.to_sampling_params(default_max_tokens=10)
    assert (info.value.code, info.value.param) == ("invalid_request", "min_tokens")


# ---------------------------------------------------------------- grammar spec


def spec(kind: str = "chat", **changes: Any) -> GrammarSpec | None:
    return parse_request(kind, body(kind, **changes)).grammar_spec()  # type: ignore[call-overload]


SCHEMA_A = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
# The same schema with its keywords in another order.
SCHEMA_A2 = {"properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "type": "object"}
# Other property order: other generated text, so another grammar.
SCHEMA_B = {"properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "type": "object"}
CANONICAL = '{"properties":{"a":{"type":"integer"},"b":{"type":"string"}},"type":"object"}'


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def test_no_constraint() -> None:
    assert spec() is None
    assert spec(response_format={"type": "text"}) is None


def test_json_schema_is_canonical_whatever_the_keyword_order_or_source() -> None:
    a = spec(response_format=json_schema_format(SCHEMA_A))
    b = spec(response_format=json_schema_format(SCHEMA_A2))
    c = spec("completion", structured_outputs={"json": json.dumps(SCHEMA_A2, indent=2)})
    d = spec(structured_outputs={"json": SCHEMA_A2}, response_format={"type": "text"})
    assert a == b == c == d == GrammarSpec("json_schema", CANONICAL)
    assert len({a, b, c, d}) == 1  # hashable: a compile-cache key
    # The property order is the generated key order: never sorted away.
    other = spec(response_format=json_schema_format(SCHEMA_B))
    assert other is not None and other != a and other.spec.index('"b"') < other.spec.index('"a"')


@pytest.mark.parametrize(
    ("changes", "expected", "param"),
    [
        ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object", ""),
         "response_format"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, GrammarSpec("regex", "[a-z]+"),
         "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, GrammarSpec("ebnf", 'root ::= "a"'),
         "structured_outputs.grammar"),
        ({"structured_outputs": {"choice": ["b", "a", "b"]}}, GrammarSpec("choice", '["a","b"]'),
         "structured_outputs.choice"),
        ({"response_format": json_schema_format(SCHEMA_A)}, GrammarSpec("json_schema", CANONICAL),
         "response_format.json_schema.schema"),
    ],
)  # fmt: skip
def test_grammar_kinds(changes: dict[str, Any], expected: GrammarSpec, param: str) -> None:
    req = parse_request("chat", body("chat", **changes))
    assert req.grammar_spec() == expected
    assert req.grammar_param() == param
