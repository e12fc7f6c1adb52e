"""tool_choice grammars: what they admit and refuse, the request checks naming the field, and
constrained decoding on the tiny model whose every output parses into calls that validate."""

from __future__ import annotations

import json

import jsonschema
import pytest

from serve_app.grammar.tools import (
    ARGUMENTS_PREFIX,
    CALL_PREFIX,
    CALL_SUFFIX,
    ToolSpecError,
    arguments_schema,
    tool_call_grammar,
    tool_names,
    validate_tools,
)
from serve_app.parsers.tools import HermesToolParser, collect
from tests.support.grammar import accepts, compile_spec


def tool(name: str, parameters: dict | None = None) -> dict:
    function = {"name": name, "description": f"{name} tool"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


_CITY = {"type": "string", "minLength": 1, "maxLength": 8}
_SMALL = {"type": "integer", "minimum": 0, "maximum": 99}
# fmt: off
TOOLS = [
    tool("get_weather", {"type": "object", "required": ["city"], "properties": {
        "city": _CITY, "unit": {"enum": ["c", "f"]}}}),
    tool("add", {"type": "object", "required": ["a", "b"], "properties": {
        "a": _SMALL, "b": _SMALL}}),
    tool("lookup", {"type": "object", "required": ["query"], "properties": {
        "query": {"type": "object", "required": ["terms"], "properties": {
            "terms": {"type": "array", "items": {"type": "string", "maxLength": 5},
                      "minItems": 1, "maxItems": 2},
            "exact": {"type": "boolean"}}}}}),
    tool("ping"),  # no parameters: the arguments are {}
]
# fmt: on
NAMES = tool_names(TOOLS)
PARAMETERS = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}
NAMED_ADD = {"type": "function", "function": {"name": "add"}}


def call(name: str, arguments: str) -> str:
    return CALL_PREFIX + name + ARGUMENTS_PREFIX + arguments + CALL_SUFFIX


WEATHER = call("get_weather", '{"city": "Paris"}')
PING = call("ping", "{}")
ADD = call("add", '{"a": 1, "b": 2}')
LOOKUP = call("lookup", '{"query": {"terms": ["naïve", "日本"], "exact": true}}')

REJECTED_BY_ALL = {
    "no call": "",
    "unknown tool": call("delete_all", "{}"),
    "missing required": call("get_weather", '{"unit": "c"}'),
    "string too long": call("get_weather", '{"city": "Amsterdam"}'),
    "out of range": call("add", '{"a": 100, "b": 2}'),
    "unlisted property": call("get_weather", '{"city": "Oslo", "x": 1}'),
    "arguments to a tool without parameters": call("ping", '{"a": 1}'),
    "arguments not an object": call("ping", "[]"),
    "no tags": '{"name": "ping", "arguments": {}}',
    "content before": "Sure. " + PING,
    "separator without a call": PING + "\n",
    "free whitespace": call("add", '{"a":1, "b": 2}'),
}
# (tool_choice, parallel_tool_calls, allow_reasoning) -> (admitted, refused beyond the above)
GRAMMAR_CASES = {
    ("required", None, False): ([WEATHER, PING, LOOKUP, ADD + "\n" + PING + "\n" + WEATHER], []),
    ("required", False, False): ([WEATHER, ADD], [ADD + "\n" + PING]),
    ("named", None, False): ([ADD], [PING, WEATHER, ADD + "\n" + ADD]),
    ("required", True, True): (
        [PING, "<think>plan: ping</think>\n\n" + PING + "\n" + ADD],
        ["<think>plan</think>" + PING, "<think>a<think>b</think>\n\n" + PING, "hm " + PING],
    ),
}


@pytest.mark.parametrize("case", sorted(GRAMMAR_CASES, key=str))
def test_grammar_admits_only_well_formed_calls_to_allowed_tools(service, engine_cache, case):
    choice, parallel, allow_reasoning = case
    tool_choice = NAMED_ADD if choice == "named" else choice
    validate_tools(TOOLS, tool_choice, parallel)
    spec = tool_call_grammar(TOOLS, tool_choice, parallel, allow_reasoning=allow_reasoning)
    assert spec is not None and spec.kind == "tool_calls"
    payload = compile_spec(service, spec.kind, spec.spec)  # the grammar service converts it
    admitted, refused = GRAMMAR_CASES[case]
    for text in admitted:
        assert accepts(engine_cache, payload, text), text
        assert HermesToolParser(NAMES).parse(text.split("</think>\n\n")[-1]).content == ""
    for text in [*refused, *REJECTED_BY_ALL.values()]:
        assert not accepts(engine_cache, payload, text), text


@pytest.mark.parametrize("tool_choice", [None, "none", "auto"])
def test_choices_the_model_makes_need_no_grammar(tool_choice):
    validate_tools(TOOLS, tool_choice, True)
    assert tool_call_grammar(TOOLS, tool_choice, True) is None


_BAD_SCHEMA = {"type": "object", "properties": {"x": {"type": "strin"}}}
# fmt: off
INVALID = [  # (tools, tool_choice, parallel_tool_calls, param named)
    ([], None, None, "tools"),
    ([], "auto", None, "tools"),
    (None, "required", None, "tool_choice"),
    (None, NAMED_ADD, None, "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice.function.name"),
    (TOOLS, {"type": "function", "function": {}}, None, "tool_choice.function.name"),
    (TOOLS, "sometimes", None, "tool_choice"),
    (TOOLS, {"type": "web_search"}, None, "tool_choice"),
    (TOOLS, "auto", "yes", "parallel_tool_calls"),
    ([{"type": "retrieval"}], None, None, "tools.0.type"),
    ([tool("ok"), tool("has space")], None, None, "tools.1.function.name"),
    ([tool("x" * 65)], None, None, "tools.0.function.name"),
    ([tool("dup"), tool("dup")], None, None, "tools.1.function.name"),
    ([tool("ok", _BAD_SCHEMA)], "auto", None, "tools.0.function.parameters"),
    ([tool("ok", {"type": "array"})], None, None, "tools.0.function.parameters"),
    ([tool("ok", {"$ref": "#/$defs/missing"})], None, None, "tools.0.function.parameters"),
]
# fmt: on


@pytest.mark.parametrize(("tools", "tool_choice", "parallel", "param"), INVALID)
def test_invalid_requests_name_the_field(tools, tool_choice, parallel, param):
    with pytest.raises(ToolSpecError) as info:
        validate_tools(tools, tool_choice, parallel)
    assert info.value.param == param
    assert str(info.value).startswith(f"{param}: ") and isinstance(info.value, ValueError)


def test_tool_choice_none_or_auto_without_tools_changes_nothing():
    for choice in ("none", "auto", None):
        validate_tools(None, choice, None)


# --------------------------------------------------------------- constrained decoding, tiny model

SEEDS = range(5)
CONFIGS = {  # name -> (tool_choice, parallel_tool_calls)
    "required": ("required", True),
    "required_single": ("required", False),
    "named": (NAMED_ADD, None),
}


@pytest.fixture(scope="module")
def llm(model_path):
    from actors import LLM

    return LLM(model=model_path)


def _generate(llm, engine_cache, service) -> dict[tuple[str, int], tuple[list[str], str]]:
    """(config, seed) -> (the text deltas in token order, finish reason), all in one batch."""
    from actors import SamplingParams

    messages = [{"role": "user", "content": "What is the weather in Paris, and 2 + 3?"}]
    text = llm.tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    prompt = llm.tokenizer.encode(text, add_special_tokens=False)
    results: dict[tuple[str, int], tuple[list[str], str]] = {}
    rids = {}
    for name, (choice, parallel) in CONFIGS.items():
        spec = tool_call_grammar(TOOLS, choice, parallel)
        payload = compile_spec(service, spec.kind, spec.spec)
        for seed in SEEDS:
            rid = rids[name, seed] = f"{name}/{seed}"
            params = SamplingParams(max_tokens=300, temperature=1.0, seed=seed)
            constraint = engine_cache.get_constraint(payload)
            llm.engine.add_request(rid, prompt, params, constraints=[constraint])
            results[name, seed] = ([], "")
    by_rid = {rid: key for key, rid in rids.items()}
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            for delta in out.deltas:
                deltas, reason = results[by_rid[out.request_id]]
                deltas.append(delta.text)
                reason = delta.finish_reason.value if delta.finish_reason else reason
                results[by_rid[out.request_id]] = (deltas, reason)
    return results


def test_constrained_generation_always_parses_into_valid_calls(llm, engine_cache, service):
    num_calls = {}
    for (name, seed), (deltas, reason) in _generate(llm, engine_cache, service).items():
        text = "".join(deltas)
        parsed = HermesToolParser(NAMES).parse(text)
        assert parsed.tool_calls, (name, seed, text)
        for tool_call in parsed.tool_calls:
            arguments = json.loads(tool_call.arguments_json)
            jsonschema.validate(arguments, arguments_schema(PARAMETERS[tool_call.name]))
        if reason == "length":
            # Only unbounded parallel calls run that long; a call cut off is content.
            assert name == "required", text
            assert parsed.content == "" or parsed.content.startswith("<tool_call>"), text
        else:
            assert reason == "stop" and parsed.content == "", (name, seed, text)
        if name != "required":
            assert len(parsed.tool_calls) == 1
        if name == "named":
            assert parsed.tool_calls[0].name == "add"
        _check_engine_deltas_stream_alike(deltas, parsed, truncated=reason == "length")
        num_calls[name, seed] = len(parsed.tool_calls)
    # Parallel calls really happen, so the ordering checks saw several calls.
    assert any(n > 1 for (name, _), n in num_calls.items() if name == "required")


def _check_engine_deltas_stream_alike(deltas: list[str], parsed, truncated: bool) -> None:
    """The engine's own deltas, streamed in token order, in both modes, give the same calls;
    an incremental stream cut inside a call has started it (a partial call, listed broken)."""
    want = [(c.name, c.arguments_json) for c in parsed.tool_calls]
    for stream_arguments in (False, True):
        parser = HermesToolParser(NAMES, stream_arguments=stream_arguments)
        streamed = collect([e for d in deltas for e in parser.feed(d)] + parser.finish())
        got = [(c.name, c.arguments_json) for c in streamed.tool_calls]
        if parser.broken_call_indices:
            assert truncated and stream_arguments
            assert parser.broken_call_indices == [len(want)] and got[:-1] == want
            assert streamed.content == ""
        else:
            assert got == want and streamed.content == parsed.content
