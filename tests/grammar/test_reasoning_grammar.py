"""Constraints after the reasoning span: what the wrapped grammars admit and refuse, for every
constraint kind, in the optional, strict and prompt-opened modes; and the end-of-turn token
never admitted mid-value (the engine would stop there)."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from serve_app.grammar.convert import spec_ebnf
from serve_app.grammar.spec import GrammarError, GrammarSpec
from serve_app.grammar.tools import CALL_PREFIX, tool_call_grammar
from tests.support.grammar import accepts, compile_spec

SCHEMA = json.dumps({"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}})
THINK = "<think>\nweigh it: {not json} ✓\n</think>\n\n"
# kind, spec, an answer it admits, an answer it refuses
CASES = [
    ("json_schema", SCHEMA, '{"n": 3}', '{"m": 3}'),
    ("json_object", "", '{"a": [1]}', "[1]"),
    ("regex", "[a-c]{2}", "ab", "abc"),
    ("choice", json.dumps(["yes", "no"]), "no", "maybe"),
    ("ebnf", 'root ::= "x" [0-9]', "x7", "y7"),
]


def wrapped(service, spec: GrammarSpec, **options):
    out = GrammarSpec.after_reasoning(spec, **options)
    assert out.kind == "after_reasoning"
    return compile_spec(service, out.kind, out.spec)  # the grammar service converts it


@pytest.mark.parametrize(("kind", "spec", "good", "bad"), CASES)
def test_the_constraint_holds_after_an_optional_reasoning_block(
    service, engine_cache, kind, spec, good, bad
):
    payload = wrapped(service, GrammarSpec(kind, spec))
    assert accepts(engine_cache, payload, good)  # no reasoning at all
    assert accepts(engine_cache, payload, THINK + good)
    assert not accepts(engine_cache, payload, bad)
    assert not accepts(engine_cache, payload, THINK + bad)
    assert not accepts(engine_cache, payload, THINK)  # the answer is still owed
    # The first `</think>` ends the block, as the reasoning parser reads it.
    assert not accepts(engine_cache, payload, "<think>a</think>b</think>\n\n" + good)
    assert not accepts(engine_cache, payload, "<think>a<think>b</think>\n\n" + good)


@pytest.mark.parametrize(("kind", "spec", "good", "bad"), CASES[:2])
def test_strict_thinking_requires_the_block(service, engine_cache, kind, spec, good, bad):
    payload = wrapped(service, GrammarSpec(kind, spec), strict=True)
    assert accepts(engine_cache, payload, THINK + good)
    assert not accepts(engine_cache, payload, good)
    assert not accepts(engine_cache, payload, THINK + bad)


def test_a_prompt_that_opened_the_block_starts_the_output_in_it(service, engine_cache):
    payload = wrapped(service, GrammarSpec("json_schema", SCHEMA), starts_in_reasoning=True)
    assert accepts(engine_cache, payload, 'still thinking {"n": 1}</think>\n\n{"n": 2}')
    assert not accepts(engine_cache, payload, '{"n": 2}')


def test_forced_tool_calls_after_reasoning(service, engine_cache):
    tools = [{"type": "function", "function": {"name": "ping"}}]
    spec = tool_call_grammar(tools, "required", False)
    payload = wrapped(service, spec)
    call = CALL_PREFIX + 'ping", "arguments": {}}\n</tool_call>'
    assert accepts(engine_cache, payload, THINK + call)
    assert accepts(engine_cache, payload, call)
    assert not accepts(engine_cache, payload, THINK + "plain text")


def test_the_end_of_turn_token_is_a_stop_token_never_text(service, engine_cache, model_path):
    """ChatML's `<|im_end|>` ends the engine's output: a grammar must admit it only where the
    output may end, never inside a reasoning block or a JSON string."""
    from transformers import AutoTokenizer

    im_end = AutoTokenizer.from_pretrained(model_path).convert_tokens_to_ids("<|im_end|>")
    payload = wrapped(service, GrammarSpec("json_schema", SCHEMA))
    matcher = engine_cache.get_constraint(payload).matcher
    bitmask = xgr.allocate_token_bitmask(1, engine_cache.tokenizer_info.vocab_size)

    def allowed() -> bool:
        matcher.fill_next_token_bitmask(bitmask)
        return bool((int(bitmask[0, im_end // 32]) >> (im_end % 32)) & 1)

    assert matcher.accept_string("<think>abc")
    assert not allowed()
    assert matcher.accept_string('</think>\n\n{"n": 4')
    assert not allowed()
    assert matcher.accept_string("}")
    assert allowed()


@pytest.mark.parametrize(
    ("kind", "spec"),
    [("regex", "[a-"), ("json_schema", '{"type": "nonsense"}'), ("ebnf", "root ::= ")],
)
def test_a_constraint_that_does_not_convert_is_a_grammar_error(service, kind, spec):
    with pytest.raises(GrammarError):
        spec_ebnf(kind, spec)
    with pytest.raises(GrammarError) as caught:  # wrapped, it is refused by the service
        wrapped(service, GrammarSpec(kind, spec))
    assert caught.value.code == "invalid_grammar"


# ------------------------------------------------------------------ strict thinking

STRICT_BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "n?"}],
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": json.loads(SCHEMA)},
    },
    "strict_thinking": True,
}


def grammar_options_for(model_path: str, **grammar_options):
    from serve_app.config.options import ServeConfig

    return ServeConfig(model=model_path, grammar=grammar_options).grammar


def test_strict_thinking_requires_the_block_where_the_server_offers_it(
    service, engine_cache, model_path
):
    from serve_app.parsers.chat_output import chat_parse_options
    from serve_app.protocol import parse_request

    req = parse_request("chat", STRICT_BODY)
    parse = chat_parse_options(req, "<|im_start|>assistant\n")
    from serve_app.workers.constraint import after_reasoning

    options = grammar_options_for(model_path, strict_thinking=True)
    spec = after_reasoning(req, req.grammar_spec(), parse, options)
    payload = compile_spec(service, spec.kind, spec.spec)
    assert accepts(engine_cache, payload, THINK + '{"n": 1}')
    assert not accepts(engine_cache, payload, '{"n": 1}')


def test_strict_thinking_is_refused_where_the_server_does_not_offer_it(model_path):
    from serve_app.errors import APIError
    from serve_app.protocol import parse_request
    from serve_app.workers.constraint import after_reasoning

    req = parse_request("chat", STRICT_BODY)
    with pytest.raises(APIError) as info:
        after_reasoning(req, req.grammar_spec(), None, grammar_options_for(model_path))
    assert (info.value.code, info.value.param) == ("unsupported_parameter", "strict_thinking")


def test_a_server_offering_strict_thinking_refuses_to_start_without_token_filtering(
    model_path, monkeypatch
):
    from serve_app import app
    from serve_app.config.options import ServeConfig

    class NoBackend:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def identity(self) -> dict:
            return {"available": False, "unavailable_reason": "tokenizer not supported"}

        def close(self) -> None:
            pass

    monkeypatch.setattr(app, "GrammarService", NoBackend)
    strict = ServeConfig(model=model_path, grammar={"strict_thinking": True})
    with pytest.raises(RuntimeError, match="strict_thinking"):
        app.probe_grammar_backend(strict)
    # Without the promise the server starts; constrained requests are then refused.
    assert app.probe_grammar_backend(ServeConfig(model=model_path))["available"] is False
