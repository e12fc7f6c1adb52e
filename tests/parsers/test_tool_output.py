"""The per-choice reader the chat endpoint runs (reasoning, then tool calls): any chunking of
an output, including the tokenizer's own token pieces, folds to the non-streamed message; calls
never interleave; a call written inside the reasoning span stays reasoning."""

from __future__ import annotations

import json

import pytest

from serve_app.parsers.chat_output import ChoiceMessage, ChoiceParser, ParseOptions, ReasoningDelta
from serve_app.parsers.tools import ContentDelta, ToolCallArgsDelta, ToolCallStart

NAMES = ("get_weather", "ping")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 日本 ✓"}}\n</tool_call>'
PING = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
THOUGHT = "<think>\nfind <tool_call> weather\n</think>\n\n"
OUTPUTS = {
    "reasoning, text, two calls": f"{THOUGHT}Sure. {CALL}\n{PING}",
    "calls only": f"{CALL}\n{PING}",
    "unknown tool is content": '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
    "cut inside reasoning": "<think>still going <tool_call>",
    "text with a lone tag": "a <tool_call> b </think> c",
}
AUTO = ParseOptions(reasoning=True, tool_names=NAMES)
FORCED = ParseOptions(reasoning=True, tool_names=NAMES, stream_arguments=True)


def read(options: ParseOptions, chunks: list[str]) -> tuple[ChoiceMessage, list]:
    parser = ChoiceParser(options)
    events = [e for chunk in chunks for e in parser.feed(chunk)] + parser.finish()
    message = ChoiceMessage()
    for event in events:
        message.add(event)
    return message, events


def summary(message: ChoiceMessage) -> tuple:
    return (
        message.reasoning,
        message.content,
        [(c.name, c.arguments_json) for c in message.tool_calls],
    )


def assert_call_order(events: list) -> None:
    """Start (whole name) before fragments; once call i+1 starts, call i gets nothing more."""
    current = -1
    for event in events:
        if isinstance(event, ToolCallStart):
            assert event.index == current + 1 and event.name in NAMES
            current = event.index
        elif isinstance(event, ToolCallArgsDelta):
            assert event.index == current


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@pytest.mark.parametrize("options", [AUTO, FORCED], ids=["auto", "forced"])
def test_every_two_way_split_reads_the_same(name, options):
    text = OUTPUTS[name]
    whole, _ = read(options, [text])
    for cut in range(len(text) + 1):
        message, events = read(options, [text[:cut], text[cut:]])
        assert summary(message) == summary(whole), cut
        assert_call_order(events)


@pytest.mark.parametrize("options", [AUTO, FORCED], ids=["auto", "forced"])
def test_character_and_token_chunkings_read_the_same(options, model_dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dirs("llama"))
    for text in OUTPUTS.values():
        whole, _ = read(options, [text])
        ids = tokenizer.encode(text, add_special_tokens=False)
        # Token by token, as the detokenizer hands out text (never half a character).
        by_token, emitted = [], ""
        for i in range(len(ids)):
            decoded = tokenizer.decode(ids[: i + 1])
            if not decoded.endswith("\ufffd"):
                by_token.append(decoded[len(emitted) :])
                emitted = decoded
        assert "".join(by_token) == text
        for chunks in (list(text), by_token):
            message, events = read(options, chunks)
            assert summary(message) == summary(whole)
            assert_call_order(events)


def test_the_split_itself():
    message, events = read(AUTO, [OUTPUTS["reasoning, text, two calls"]])
    assert message.reasoning == "find <tool_call> weather"  # a call inside reasoning is reasoning
    assert message.content == "Sure."
    assert [(c.name, json.loads(c.arguments_json)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Zürich 日本 ✓"}),
        ("ping", {}),
    ]
    kinds = [type(e) for e in events]
    assert kinds.index(ReasoningDelta) < kinds.index(ContentDelta) < kinds.index(ToolCallStart)


def test_forced_mode_streams_arguments_before_the_closing_tag():
    parser = ChoiceParser(FORCED)
    events = parser.feed(CALL[: CALL.index("日")])
    assert isinstance(events[0], ToolCallStart) and events[0].name == "get_weather"
    assert "".join(e.fragment for e in events[1:]) == '{"city": "Zürich '


def test_a_call_cut_short_is_marked_broken():
    parser = ChoiceParser(FORCED)
    parser.feed(CALL[:-20])
    parser.finish()
    assert parser.broken_call_indices == [0]


def test_plain_options_read_nothing():
    assert ParseOptions().is_plain
    message, _ = read(ParseOptions(), [OUTPUTS["reasoning, text, two calls"]])
    assert message.content == OUTPUTS["reasoning, text, two calls"] and not message.tool_calls
