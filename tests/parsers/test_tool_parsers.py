"""Tool-call parser: exact non-streamed results, and the stream contract under every chunking
(all two-chunk splits, one character at a time, random cuts) in both streaming modes."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest

from serve_app.parsers.tools import (
    ContentDelta,
    Event,
    HermesToolParser,
    ParsedOutput,
    StreamingToolParser,
    ToolCallArgsDelta,
    ToolCallStart,
    collect,
    get_parser,
    parser_versions,
    register,
)

TOOLS = ("get_weather", "search")


def call(name: str, arguments: str, newlines: bool = True) -> str:
    nl = "\n" if newlines else ""
    return f'<tool_call>{nl}{{"name": "{name}", "arguments": {arguments}}}{nl}</tool_call>'


WEATHER = '{"city": "Paris", "unit": "c"}'
UTF8 = (
    r'{"text": "naïve — 日本 🎉", "quote": "a \"b\" \\ c", '
    + r'"esc": "\u00e9", "tag": "</tool_call>}{"}'
)
NESTED = '{"a": {"b": [1, {"c": [true, null, -2.5e3]}], "d": {}}, "e": [], "f": "x"}'
BAD_JSON = call("get_weather", '{"city": }')
# name -> (text, content (None: the text verbatim), [(name, arguments_json)]), tools = TOOLS
CASES: dict[str, tuple[str, str | None, list[tuple[str, str]]]] = {
    "content_only": ("Hi <tool> or <tool_call is cut; </tool_call> alone.\n\n", None, []),
    "one_call": (call("get_weather", WEATHER), "", [("get_weather", WEATHER)]),
    "two_calls_with_content": (
        "Let me check.\n"
        + call("get_weather", WEATHER)
        + "\nand then\n"
        + call("search", '{"q": "rain"}', newlines=False)
        + "\nDone.\n",
        "Let me check.\nand then\nDone.\n",
        [("get_weather", WEATHER), ("search", '{"q": "rain"}')],
    ),
    "parallel_calls": (
        call("get_weather", WEATHER) + "\n" + call("search", NESTED) + "\n",
        "",
        [("get_weather", WEATHER), ("search", NESTED)],
    ),
    "utf8_and_escapes": ("  " + call("search", UTF8) + " ok", "ok", [("search", UTF8)]),
    "nested": (call("search", NESTED), "", [("search", NESTED)]),
    "bad_json": ("Before " + BAD_JSON, None, []),
    "unknown_tool": (call("delete_all", "{}") + "\n", None, []),
    "arguments_not_object": (call("search", "[1, 2]"), None, []),
    "missing_name": ('<tool_call>{"arguments": {}}</tool_call>', None, []),
    "extra_key": ('<tool_call>{"name": "search", "arguments": {}, "id": 1}</tool_call>', None, []),
    "nan_argument": (call("search", '{"x": NaN}'), None, []),
    "unterminated": ("Sure. " + '<tool_call>\n{"name": "search", "arguments": {"q": "x', None, []),
    "bad_then_good": (
        "<tool_call>oops</tool_call> " + call("search", '{"q": 1}'),
        "<tool_call>oops</tool_call>",
        [("search", '{"q": 1}')],
    ),
    "key_order_swapped": (
        '<tool_call>{"arguments": {"q": "z"}, "name": "search"}</tool_call>',
        "",
        [("search", '{"q": "z"}')],
    ),
}
# Malformed calls whose head `{"name": <known>, "arguments": {` is well formed: an incremental
# stream has started them before it can know (what the grammar rules out). -> content then
STARTED_THEN_BROKEN = {
    "bad_json": "Before",
    "nan_argument": "",
    "unterminated": "Sure.",
    "extra_key": ', "id": 1}</tool_call>',  # scanning resumes where the body broke
}


def expected(name: str) -> ParsedOutput:
    text, content, calls = CASES[name]
    parsed = HermesToolParser(TOOLS).parse(text)
    assert parsed.content == (text if content is None else content)
    assert [(c.name, c.arguments_json) for c in parsed.tool_calls] == calls
    return parsed


def chunkings(text: str, seed: int = 0, num_random: int = 40) -> Iterator[list[str]]:
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for _ in range(num_random):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 30))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def stream(parser: StreamingToolParser, chunks: list[str]) -> list[tuple[int, Event]]:
    """Events tagged with the number of the feed that produced them (len(chunks) = finish)."""
    events = [(i, e) for i, chunk in enumerate(chunks) for e in parser.feed(chunk)]
    return events + [(len(chunks), e) for e in parser.finish()]


def check_stream(events: list[Event], want: ParsedOutput) -> None:
    got = collect(events)
    assert got.content == want.content
    assert [(c.name, c.arguments_json) for c in got.tool_calls] == [
        (c.name, c.arguments_json) for c in want.tool_calls
    ]
    current = -1
    for event in events:
        if isinstance(event, ToolCallStart):
            assert event.index == current + 1, "calls start in order, once each"
            current = event.index
            assert event.name == want.tool_calls[event.index].name, "the name is sent whole"
        elif isinstance(event, ToolCallArgsDelta):
            assert event.index == current, "fragments follow their own start, never interleave"
            assert event.fragment
        else:
            assert event.text
    if "<" not in want.content:
        # Nothing of a tag that became a call ever leaked into content, even transiently.
        assert not any(isinstance(e, ContentDelta) and "<" in e.text for e in events)


@pytest.mark.parametrize("name", sorted(CASES))
def test_non_streamed_result(name):
    parsed = expected(name)
    for c in parsed.tool_calls:
        assert c.id.startswith("call_") and isinstance(json.loads(c.arguments_json), dict)
    assert len({c.id for c in parsed.tool_calls}) == len(parsed.tool_calls)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("stream_arguments", [False, True])
def test_every_chunking_streams_the_non_streamed_result(name, stream_arguments):
    want = expected(name)
    text = CASES[name][0]
    broken = stream_arguments and name in STARTED_THEN_BROKEN
    for chunks in chunkings(text, seed=len(name)):
        parser = HermesToolParser(TOOLS, stream_arguments=stream_arguments)
        events = [e for _, e in stream(parser, chunks)]
        if broken:
            # The start went out before the body turned bad: the call stays, partial.
            got = collect(events)
            assert parser.broken_call_indices == [0] and len(got.tool_calls) == 1
            assert got.content == STARTED_THEN_BROKEN[name]
            args = text[text.index('"arguments": ') + len('"arguments": ') :]
            assert args.startswith(got.tool_calls[0].arguments_json)
            continue
        assert parser.broken_call_indices == []
        check_stream(events, want)


def test_validated_mode_emits_a_call_only_at_its_closing_tag():
    text = call("get_weather", WEATHER)
    events = stream(HermesToolParser(TOOLS), list(text))
    assert [type(e) for _, e in events] == [ToolCallStart, ToolCallArgsDelta]
    assert {feed for feed, _ in events} == {len(text) - 1}


def test_incremental_mode_streams_arguments_as_they_are_generated():
    text = call("search", NESTED)
    events = stream(HermesToolParser(TOOLS, stream_arguments=True), list(text))
    start_feed = text.index('"arguments": {') + len('"arguments": ')
    assert events[0] == (start_feed, events[0][1]) and isinstance(events[0][1], ToolCallStart)
    fragments = [e.fragment for _, e in events[1:]]
    assert "".join(fragments) == NESTED and len(fragments) == len(NESTED)


def test_an_unknown_name_never_starts_even_when_incremental():
    text = call("delete_all", "{}")
    parser = HermesToolParser(TOOLS, stream_arguments=True)
    events = [e for _, e in stream(parser, list(text))]
    assert collect(events) == ParsedOutput(text, [])
    # Without a tool list any name is accepted.
    assert HermesToolParser().parse(text).tool_calls[0].name == "delete_all"


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("\n\n" + call("search", "{}") + "\n\n", ""),  # around a lone call: all trimmed
        ("A " + call("search", "{}") + " B", "A B"),  # before a call trimmed, after kept
        ("A\n" + call("search", "{}") + "\n" + call("search", "{}") + "\nB", "A\nB"),
        (call("search", "{}") + "\nB", "B"),  # would start the content
        ("A \n", "A \n"),  # no call: content is verbatim
        ("A\n<tool_call>bad</tool_call>\n", "A\n<tool_call>bad</tool_call>\n"),
    ],
)
def test_whitespace_next_to_calls(text, content):
    assert HermesToolParser(TOOLS).parse(text).content == content
    for chunks in chunkings(text, num_random=5):
        assert collect(e for _, e in stream(HermesToolParser(TOOLS), chunks)).content == content


def test_parser_state_belongs_to_one_request():
    a, b = HermesToolParser(TOOLS), HermesToolParser(TOOLS)
    text = call("search", '{"q": 1}')
    half = len(text) // 2
    events_a = a.feed(text[:half])
    assert b.parse("plain") == ParsedOutput("plain", [])  # another parser, and parse()
    assert a.parse(text[half:]).tool_calls == []  # parse() never touches the stream
    events_a += a.feed(text[half:]) + a.finish()
    assert [c.name for c in collect(events_a).tool_calls] == ["search"]
    with pytest.raises(RuntimeError):
        a.feed("more")
    with pytest.raises(RuntimeError):
        a.finish()


def test_registry_names_and_versions():
    assert get_parser("hermes") is HermesToolParser
    assert parser_versions()["hermes"] == HermesToolParser.version
    with pytest.raises(ValueError, match="unknown tool parser 'nope'; known: hermes"):
        get_parser("nope")
    with pytest.raises(ValueError, match="already registered"):
        register(HermesToolParser)
