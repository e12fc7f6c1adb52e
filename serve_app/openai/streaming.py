"""Server-sent events for the OpenAI endpoints, framed through an order-enforcing state machine.

The promised order, per stream: for each choice a role delta, then its content deltas
(content, reasoning_content and tool-call deltas, in generation order), then
exactly one chunk with its `finish_reason`; after every choice has finished, one usage chunk
(`choices: []`) when the client asked for it; then `data: [DONE]`. A failure after the
headers went out is one `data: {"error": ...}` frame, then `[DONE]`. Nothing follows [DONE].
Completions streams have no role delta (`role_first=False`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Protocol

import orjson

DONE = b"data: [DONE]\n\n"


class _Dumpable(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


# What str.splitlines (and so httpx's `aiter_lines`) ends a line at, beyond the CR and LF that
# JSON escapes itself: NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR, as UTF-8. Text a model
# generates may hold them; inside a JSON string their escapes mean the same characters.
_LINE_BREAKS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def _escape_line_breaks(json_bytes: bytes) -> bytes:
    if b"\xc2\x85" in json_bytes or b"\xe2\x80" in json_bytes:
        for raw, escaped in _LINE_BREAKS:
            json_bytes = json_bytes.replace(raw, escaped)
    return json_bytes


def dumps(data: Any) -> bytes:
    """Compact JSON (orjson) that every line-splitting SSE reader keeps on one line: orjson
    escapes CR, LF and the other control characters, and the Unicode line breaks it writes
    raw are escaped here."""
    return _escape_line_breaks(orjson.dumps(data))


def sse(data: Mapping[str, Any] | str) -> bytes:
    """One SSE event; a str is taken as already-serialized JSON."""
    if not isinstance(data, str):
        return b"data: " + dumps(data) + b"\n\n"
    # NOTE: a raw newline would end the event early and the rest would be a second, bogus one.
    if "\n" in data or "\r" in data:
        raise ValueError("an SSE data line cannot contain a newline")
    return b"data: " + _escape_line_breaks(data.encode()) + b"\n\n"


class ChunkFrames:
    """One stream's chunk envelope (id, object, created, model, fingerprint) serialized once:
    a one-choice chunk is framed as the envelope's bytes around its choice's JSON, so the
    per-token path serializes only what changes."""

    _CHOICES = b'"choices":[]'

    def __init__(self, envelope: Mapping[str, Any]) -> None:
        if envelope.get("choices") != [] or envelope.get("usage") is not None:
            raise ValueError("an envelope is a chunk with `choices: []` and no usage")
        # NOTE: the key's quotes are unescaped only in the key itself (a string value's
        # quotes are escaped), so the split is unambiguous.
        head, sep, tail = dumps(envelope).partition(self._CHOICES)
        if not sep or self._CHOICES in tail:
            raise ValueError("the envelope's `choices` key was not found once")
        self._head = b"data: " + head + b'"choices":['
        self._tail = b"]" + tail + b"\n\n"

    def frame(self, choice: Mapping[str, Any]) -> bytes:
        return self._head + dumps(choice) + self._tail


class StreamOrderError(AssertionError):
    """A caller tried to emit an event the stream contract does not allow at this point."""


class _Phase(enum.Enum):
    OPEN = "open"
    ERRORED = "errored"
    CLOSED = "closed"


class StreamState:
    def __init__(
        self, num_choices: int, *, include_usage: bool = False, role_first: bool = True
    ) -> None:
        if num_choices < 1:
            raise ValueError("a stream has at least one choice")
        self.num_choices = num_choices
        self.include_usage = include_usage
        self.role_first = role_first
        self._phase = _Phase.OPEN
        self._role_sent = [False] * num_choices
        self._finished = [False] * num_choices
        self._usage_sent = False

    # ------------------------------------------------------------------ queries

    @property
    def is_closed(self) -> bool:
        return self._phase is _Phase.CLOSED

    @property
    def all_finished(self) -> bool:
        return all(self._finished)

    @property
    def is_complete(self) -> bool:
        """Every choice finished and usage sent if asked: only [DONE] may follow."""
        return self.all_finished and (self._usage_sent or not self.include_usage)

    # -------------------------------------------------------------- transitions

    def role(self, index: int) -> None:
        self._require_choice_open(index)
        if not self.role_first:
            raise StreamOrderError("this stream has no role deltas")
        if self._role_sent[index]:
            raise StreamOrderError(f"choice {index}: role delta sent twice")
        self._role_sent[index] = True

    def content(self, index: int) -> None:
        self._require_choice_open(index)
        self._require_role(index, "content")

    def finish(self, index: int) -> None:
        self._require_choice_open(index)
        self._require_role(index, "finish_reason")
        self._finished[index] = True

    def usage(self) -> None:
        self._require_open("usage")
        if not self.include_usage:
            raise StreamOrderError("usage chunk not asked for (stream_options.include_usage)")
        if self._usage_sent:
            raise StreamOrderError("usage chunk sent twice")
        if not self.all_finished:
            raise StreamOrderError("usage chunk before every choice finished")
        self._usage_sent = True

    def error(self) -> None:
        self._require_open("error")
        if self.is_complete:
            raise StreamOrderError("error after the stream completed")
        self._phase = _Phase.ERRORED

    def done(self) -> None:
        if self._phase is _Phase.CLOSED:
            raise StreamOrderError("[DONE] sent twice")
        if self._phase is _Phase.OPEN and not self.is_complete:
            missing = "usage chunk" if self.all_finished else "a finish chunk per choice"
            raise StreamOrderError(f"[DONE] before {missing}")
        self._phase = _Phase.CLOSED

    def _require_open(self, what: str) -> None:
        if self._phase is not _Phase.OPEN:
            raise StreamOrderError(f"{what} after the stream {self._phase.value}")

    def _require_choice_open(self, index: int) -> None:
        self._require_open(f"choice {index} event")
        if not 0 <= index < self.num_choices:
            raise StreamOrderError(f"choice index {index} out of range [0, {self.num_choices})")
        if self._finished[index]:
            raise StreamOrderError(f"choice {index}: event after its finish chunk")
        if self._usage_sent:
            raise StreamOrderError("choice event after the usage chunk")

    def _require_role(self, index: int, what: str) -> None:
        if self.role_first and not self._role_sent[index]:
            raise StreamOrderError(f"choice {index}: {what} before the role delta")

    # ------------------------------------------------------------------ framing

    def frame_chunk(self, chunk: Mapping[str, Any] | _Dumpable) -> bytes:
        """Check a chat or completions chunk against the order, then frame it."""
        data = chunk if isinstance(chunk, Mapping) else chunk.to_dict()
        choices = data.get("choices") or []
        if not choices:
            if data.get("usage") is None:
                raise StreamOrderError("a chunk without choices must be the usage chunk")
            self.usage()
            return sse(data)
        if data.get("usage") is not None:
            raise StreamOrderError("usage belongs in its own chunk with `choices: []`")
        self._require_open("chunk")
        for choice in choices:
            self._check_choice(choice)
        return sse(data)

    def frame_choice(self, frames: ChunkFrames, choice: Mapping[str, Any]) -> bytes:
        """A one-choice chunk of this stream's envelope: checked as `frame_chunk` checks it."""
        self._require_open("chunk")
        self._check_choice(choice)
        return frames.frame(choice)

    def _check_choice(self, choice: Mapping[str, Any]) -> None:
        index = choice["index"]
        delta = choice.get("delta")
        if delta is not None and delta.get("role") is not None:
            self.role(index)
        if _has_content(choice, delta):
            self.content(index)
        if choice.get("finish_reason") is not None:
            self.finish(index)

    def frame_error(self, error: Mapping[str, Any] | Any) -> bytes:
        """An APIError (anything with `.body()`) or an `{"error": {...}}` body."""
        body = error if isinstance(error, Mapping) else error.body()
        if "error" not in body:
            raise ValueError("an error frame is {'error': {...}}")
        self.error()
        return sse(body)

    def frame_done(self) -> bytes:
        self.done()
        return DONE


def _has_content(choice: Mapping[str, Any], delta: Mapping[str, Any] | None) -> bool:
    if delta is not None:
        # Reasoning, tool-call deltas and a logprobs-only chunk are events of the choice too.
        given = delta.get("content") is not None or delta.get("reasoning_content") is not None
        return given or bool(delta.get("tool_calls")) or choice.get("logprobs") is not None
    # Completions chunks carry text directly; the finish chunk's "" is not content.
    return bool(choice.get("text")) or choice.get("logprobs") is not None
