from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChunk

from serve_app import errors
from serve_app.openai.streaming import DONE, ChunkFrames, StreamOrderError, StreamState, sse
from serve_app.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    Usage,
    openai_finish_reason,
)

# --------------------------------------------------------------------- chunks


def chat_chunk(index: int = 0, role: bool = False, content: str | None = None,
               finish: str | None = None) -> ChatCompletionChunk:  # fmt: skip
    delta = DeltaMessage(role="assistant" if role else None, content=content)
    choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish)
    return ChatCompletionChunk(id="c", model="m", choices=[choice], system_fingerprint="fp")


def usage_chunk() -> ChatCompletionChunk:
    return ChatCompletionChunk(id="c", model="m", choices=[], usage=Usage.of(3, 2))


def text_chunk(index: int = 0, text: str = "", finish: str | None = None) -> CompletionChunk:
    choice = CompletionChoice(index=index, text=text, finish_reason=finish)
    return CompletionChunk(id="c", model="m", choices=[choice])


def decode(frame: bytes) -> Any:
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    payload = frame[len(b"data: ") : -2]
    return payload.decode() if payload == b"[DONE]" else json.loads(payload)


# ---------------------------------------------------------------- legal order


def test_single_choice_stream_parses_with_the_openai_types() -> None:
    state = StreamState(1)
    frames = [
        state.frame_chunk(chat_chunk(role=True, content="")),
        state.frame_chunk(chat_chunk(content="Hel")),
        state.frame_chunk(chat_chunk(content="lo")),
        state.frame_chunk(chat_chunk(finish="stop")),
        state.frame_done(),
    ]
    assert frames[-1] == DONE and state.is_closed
    events = [decode(f) for f in frames[:-1]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[3]["choices"][0]["delta"] == {}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "Hello"
    for event in events:
        OpenAIChunk.model_validate(event)


def test_interleaved_choices_then_usage() -> None:
    state = StreamState(2, include_usage=True)
    for chunk in [
        chat_chunk(0, role=True),
        chat_chunk(1, role=True, content="b"),
        chat_chunk(0, content="a"),
        chat_chunk(1, content="c", finish="length"),
        chat_chunk(0, finish="stop"),
    ]:
        state.frame_chunk(chunk)
    assert state.all_finished and not state.is_complete
    usage = decode(state.frame_chunk(usage_chunk()))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5
    assert state.is_complete
    state.frame_done()


def test_completion_stream_has_no_role() -> None:
    state = StreamState(1, role_first=False)
    state.frame_chunk(text_chunk(text="a"))
    state.frame_chunk(text_chunk(text="", finish="stop"))
    state.frame_done()
    with pytest.raises(StreamOrderError):
        StreamState(1, role_first=False).role(0)


@pytest.mark.parametrize("after_role", [False, True])
def test_error_after_headers_then_done(after_role: bool) -> None:
    state = StreamState(1)
    if after_role:
        state.frame_chunk(chat_chunk(role=True, content="x"))
    frame = decode(state.frame_error(errors.internal_error("engine lost")))
    assert frame["error"]["code"] == "internal_error"
    assert state.frame_done() == DONE


def test_sse_framing() -> None:
    # UTF-8 on the wire (SSE is UTF-8); a newline inside a value is escaped, never raw.
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert sse({"a": "x\ny"}) == b'data: {"a":"x\\ny"}\n\n'
    assert sse('{"x":1}') == b'data: {"x":1}\n\n'
    with pytest.raises(ValueError):
        sse('{"x":\n1}')


@pytest.mark.parametrize("char", ["\x85", "\u2028", "\u2029", "\x0b", "\x0c", "\x1c", "\x1e"])
def test_an_event_stays_one_line_for_readers_that_split_at_unicode_line_breaks(char) -> None:
    """httpx's `aiter_lines` (like str.splitlines) also ends a line at NEL, LINE SEPARATOR and
    PARAGRAPH SEPARATOR, which JSON may carry raw: a generated one split a chunk in two and
    the client read half a JSON document. Each frame is one line, and decodes to the text."""
    text = f"a{char}b"
    frames = ChunkFrames({"id": "c", "object": "chunk", "choices": []})
    for event in (
        sse({"text": text}),
        sse(json.dumps({"text": text}, ensure_ascii=False)),
        frames.frame({"index": 0, "text": text}),
    ):
        assert event.endswith(b"\n\n")
        lines = event[:-2].decode().splitlines()
        assert len(lines) == 1, event
        decoded = json.loads(lines[0].removeprefix("data: "))
        assert text in (decoded.get("text"), decoded.get("choices", [{}])[0].get("text"))


# -------------------------------------------------------------- illegal order


def opened(n: int = 1, usage: bool = False) -> StreamState:
    state = StreamState(n, include_usage=usage)
    for i in range(n):
        state.role(i)
    return state


def finished(usage: bool = False) -> StreamState:
    state = opened(usage=usage)
    state.finish(0)
    return state


def closed() -> StreamState:
    state = finished()
    state.done()
    return state


def errored() -> StreamState:
    state = opened()
    state.error()
    return state


ILLEGAL: list[tuple[str, Callable[[], StreamState], Callable[[StreamState], Any]]] = [
    ("content before role", lambda: StreamState(1), lambda s: s.content(0)),
    ("finish before role", lambda: StreamState(1), lambda s: s.finish(0)),
    ("role twice", opened, lambda s: s.role(0)),
    ("content after finish", finished, lambda s: s.content(0)),
    ("finish twice", finished, lambda s: s.finish(0)),
    ("index out of range", opened, lambda s: s.content(1)),
    ("negative index", opened, lambda s: s.content(-1)),
    ("usage not asked for", finished, lambda s: s.usage()),
    ("usage before finish", lambda: opened(2, usage=True), lambda s: (s.finish(0), s.usage())),
    ("usage twice", lambda: finished(usage=True), lambda s: (s.usage(), s.usage())),
    ("done before finish", opened, lambda s: s.done()),
    ("done before usage", lambda: finished(usage=True), lambda s: s.done()),
    ("done twice", closed, lambda s: s.done()),
    ("chunk after done", closed, lambda s: s.frame_chunk(chat_chunk(content="x"))),
    ("error after done", closed, lambda s: s.error()),
    ("content after error", errored, lambda s: s.content(0)),
    ("usage after error", errored, lambda s: s.usage()),
    ("error twice", errored, lambda s: s.error()),
    ("error after completion", finished, lambda s: s.error()),
    ("empty chunk", opened, lambda s: s.frame_chunk({"choices": []})),
    ("usage inside a content chunk", opened,
     lambda s: s.frame_chunk({**chat_chunk(content="x").to_dict(), "usage": Usage.of(1, 1)})),
    ("role delta after content", opened,
     lambda s: (s.frame_chunk(chat_chunk(content="x")), s.frame_chunk(chat_chunk(role=True)))),
]  # fmt: skip


@pytest.mark.parametrize(("name", "make", "act"), ILLEGAL, ids=[c[0] for c in ILLEGAL])
def test_illegal_transition_raises(name: str, make, act) -> None:
    state = make()
    with pytest.raises(StreamOrderError):
        act(state)


def test_stream_order_error_is_an_assertion() -> None:
    assert issubclass(StreamOrderError, AssertionError)


# ------------------------------------------------------------- response bodies


def test_chat_completion_body_is_what_openai_clients_read() -> None:
    logprobs = ChatLogprobs(
        content=[ChatTokenLogprob.build("é", -0.5, [("é", -0.5), ("e", -math.inf)])]
    )
    body = ChatCompletionResponse(
        id="chatcmpl-1",
        model="m",
        choices=[
            ChatChoice(
                index=0,
                message=ChatResponseMessage(content="hi"),
                logprobs=logprobs,
                finish_reason="stop",
                stop_reason="grammar_end",
            )
        ],
        usage=Usage.of(prompt_tokens=10, completion_tokens=3, cached_tokens=8),
        system_fingerprint="fp_abc",
    ).to_dict()
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.content == "hi"
    assert parsed.usage is not None and parsed.usage.total_tokens == 13
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
    entry = body["choices"][0]["logprobs"]["content"][0]
    assert entry["bytes"] == [0xC3, 0xA9]
    assert entry["top_logprobs"][1]["logprob"] == -9999.0
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "hi",
        "reasoning_content": None,
    }
    json.dumps(body, allow_nan=False)


def test_completion_body_and_logprob_offsets() -> None:
    lp = CompletionLogprobs.build(
        ["He", "llo"], [-0.1, -0.2], [[("He", -0.1)], [("llo", -0.2), ("y", -3.0)]], 5
    )
    body = CompletionResponse(
        id="cmpl-1",
        model="m",
        choices=[CompletionChoice(index=0, text="Hello", logprobs=lp, finish_reason="length")],
        usage=Usage.of(2, 2),
    ).to_dict()
    parsed = Completion.model_validate(body)
    assert parsed.choices[0].logprobs is not None
    assert parsed.choices[0].logprobs.text_offset == [5, 7]
    assert body["choices"][0]["logprobs"]["top_logprobs"][1] == {"llo": -0.2, "y": -3.0}
    assert body["object"] == "text_completion"


@pytest.mark.parametrize(
    ("engine", "stop_reason", "expected"),
    [
        ("stop", "###", ("stop", "###")),
        ("stop", 2, ("stop", 2)),
        ("length", None, ("length", None)),
        ("stop", "grammar_end", ("stop", "grammar_end")),  # how the engine signals it
        ("timeout", None, ("timeout", None)),
        ("abort", "slow_consumer", ("abort", "slow_consumer")),
    ],
)
def test_openai_finish_reason(engine: str, stop_reason: Any, expected: tuple[str, Any]) -> None:
    assert openai_finish_reason(engine, stop_reason) == expected


def test_engine_error_is_never_a_finish_reason() -> None:
    with pytest.raises(ValueError):
        openai_finish_reason("error")
