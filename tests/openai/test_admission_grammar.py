"""A request without an output constraint never calls the grammar deployment: the hop (a
Serve round trip) is paid only by requests that have a grammar to compile."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from serve_app.openai.admission import OpenAIAdmission
from serve_app.protocol import parse_request

MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


class RecordingGrammar:
    """The grammar deployment's handle: records each compile it is asked for."""

    def __init__(self) -> None:
        self.compiled: list = []
        self.compile = SimpleNamespace(remote=self._remote)

    def _remote(self, spec):
        self.compiled.append(spec)

        async def ref():
            return f"ref-{len(self.compiled)}"

        return SimpleNamespace(_to_object_ref=ref)


def admission(grammar: RecordingGrammar) -> OpenAIAdmission:
    config = SimpleNamespace(grammar=SimpleNamespace(max_spec_bytes=65536, strict_thinking=False))
    identity = {"max_model_len": 1024, "grammar": {"available": True}}
    return OpenAIAdmission(config, identity, texts=None, grammar=grammar)


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("chat", {"messages": MESSAGES}),
        ("chat", {"messages": MESSAGES, "response_format": {"type": "text"}}),
        ("chat", {"messages": MESSAGES, "tools": [TOOL], "tool_choice": "auto"}),
        ("chat", {"messages": MESSAGES, "tools": [TOOL], "tool_choice": "none"}),
        ("completion", {"prompt": "hi"}),
    ],
    ids=["plain", "text-format", "tools-auto", "tools-none", "completions"],
)
def test_no_grammar_no_call(kind, body):
    grammar = RecordingGrammar()
    req = parse_request(kind, {"model": "m", **body})
    assert asyncio.run(admission(grammar).start_grammar(req, None)) is None
    assert grammar.compiled == []


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_object"}},
        {"tools": [TOOL], "tool_choice": "required"},
    ],
    ids=["json-object", "tools-required"],
)
def test_a_grammar_is_one_call(extra):
    grammar = RecordingGrammar()
    req = parse_request("chat", {"model": "m", "messages": MESSAGES, **extra})
    assert asyncio.run(admission(grammar).start_grammar(req, None)) == ["ref-1"]
    assert len(grammar.compiled) == 1
