"""Tool-call parsers: model text -> content and OpenAI tool calls, streamed or all at once.

One parser instance per request, fed its text deltas in token order. It emits `ContentDelta`,
`ToolCallStart` (the whole name, once) and `ToolCallArgsDelta` (argument text in order, after its
start); calls never interleave and are indexed from 0. `parse(text)` runs a fresh instance over
the whole text, so the non-streamed result is by construction what any chunking streams.

Hermes / Qwen convention: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A call is
well formed when the tag body is one JSON object with exactly `name` (a non-empty string, one of
the request's tools when a list is given) and `arguments` (an object; no NaN/Infinity);
`arguments_json` is the arguments' exact text as generated. All else is content, verbatim, but
whitespace next to a call: the run just before one, and the run just after one where it would
start the content or end the text. The body is scanned JSON-aware (`</tool_call>` inside a
string does not end it); a body that cannot become a call (text before `{`, a mismatched
bracket, a raw control character in a string, text after the object) ends there: its text is
content and scanning resumes at the offending character.

Trade-off, per request (`stream_arguments`):
- False, validated (for `tool_choice: auto`): a call is held from `<tool_call>` to its closing
  tag and checked; a good one is emitted as its start plus one argument fragment, a bad one as
  content. A client never receives a call it cannot parse; arguments arrive at once.
- True, incremental (only where a grammar enforces well-formed calls: `required`, a named
  function): the start goes out once `{"name": <known tool>, "arguments": {` is complete, then
  argument text streams as generated. A started call cannot be retracted: cut by max_tokens or
  (not possible under the grammar) malformed, it stays partial, is listed in
  `broken_call_indices`, and scanning resumes where it broke. Other key orders are validated.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

_WS = " \t\r\n"
_CLOSERS = {"}": "{", "]": "["}


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    index: int
    fragment: str


Event = ContentDelta | ToolCallStart | ToolCallArgsDelta


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str


@dataclass
class ParsedOutput:
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def collect(events: Iterable[Event]) -> ParsedOutput:
    """Fold a parser's events into the non-streamed result."""
    content: list[str] = []
    calls: dict[int, ToolCall] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            calls[event.index] = ToolCall(event.id, event.name, "")
        else:
            call = calls[event.index]
            calls[event.index] = replace(call, arguments_json=call.arguments_json + event.fragment)
    return ParsedOutput("".join(content), [calls[i] for i in sorted(calls)])


class StreamingToolParser(ABC):
    """Per-request parser state. Invariants every implementation keeps, whatever the chunking:
    content never holds text that later became part of a call; a call's start precedes its
    fragments; fragments of call i all come before call i+1 starts; `parse(text)` equals the
    folded events of any chunking of `text`, ids aside (and but for `broken_call_indices`)."""

    name: ClassVar[str]
    version: ClassVar[str]

    def __init__(
        self,
        tool_names: Iterable[str] | None = None,
        *,
        stream_arguments: bool = False,
        make_call_id: Callable[[], str] = new_call_id,
    ) -> None:
        self.tool_names = frozenset(tool_names) if tool_names is not None else None
        self.stream_arguments = stream_arguments
        self.make_call_id = make_call_id
        self.broken_call_indices: list[int] = []
        self.num_calls = 0
        self.is_finished = False
        self._reset()

    @abstractmethod
    def _reset(self) -> None:
        """Set up the implementation's per-request state."""

    @abstractmethod
    def feed(self, delta: str) -> list[Event]: ...

    @abstractmethod
    def finish(self) -> list[Event]:
        """The end of the output: release held text. The parser takes no input after it."""

    def parse(self, text: str) -> ParsedOutput:
        """The whole output at once, on fresh state (this instance's stream is untouched)."""
        parser = type(self)(self.tool_names, make_call_id=self.make_call_id)
        return collect([*parser.feed(text), *parser.finish()])


_PARSERS: dict[str, type[StreamingToolParser]] = {}


def register(cls: type[StreamingToolParser]) -> type[StreamingToolParser]:
    if cls.name in _PARSERS:
        raise ValueError(f"a tool parser named {cls.name!r} is already registered")
    _PARSERS[cls.name] = cls
    return cls


def get_parser(name: str) -> type[StreamingToolParser]:
    if name not in _PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(_PARSERS))}")
    return _PARSERS[name]


def parser_versions() -> dict[str, str]:
    """name -> version of every registered parser, for /v1/server_info."""
    return {name: cls.version for name, cls in sorted(_PARSERS.items())}


TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# The body up to the arguments value, when the name comes first (as the grammar writes it).
_J = r"[ \t\r\n]*"  # JSON whitespace only: Python's \s admits more
_HEAD = re.compile(
    rf'{_J}\{{{_J}"name"{_J}:{_J}("(?:[^"\\\x00-\x1f]|\\.)*"){_J},{_J}"arguments"{_J}:{_J}'
)


def _load_call(body: str) -> Any:
    """The JSON value filling `body`, or None; repeated keys and NaN/Infinity are not JSON."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        if len({key for key, _ in pairs}) != len(pairs):
            raise ValueError("repeated key")
        return dict(pairs)

    def reject(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(body, object_pairs_hook=unique, parse_constant=reject)
    except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
        return None


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    start = max(0, len(text) - len(tag) + 1)
    for j in range(start, len(text)):
        if text[j] == tag[0] and tag.startswith(text[j:]):
            return len(text) - j
    return 0


_PRE, _OBJ, _POST = "pre", "obj", "post"  # candidate phases: before `{`, in the object, after
_DEVIATE, _DONE = "deviate", "done"


@register
class HermesToolParser(StreamingToolParser):
    name = "hermes"
    version = "1"

    def _reset(self) -> None:
        self._buf, self._in_call = "", False  # input not consumed yet
        self._out: list[Event] = []
        self._ws = ""  # a trailing whitespace run of content: held, a call may follow
        self._after_call = False  # only whitespace since the last call
        self._has_content = False
        self._new_candidate("")

    def _new_candidate(self, pre_ws: str) -> None:
        self._pre_ws = pre_ws  # held whitespace before `<tool_call>`: content if it fails
        self._cand = ""  # text after `<tool_call>` consumed so far
        self._phase = _PRE
        self._stack: list[str] = []
        self._in_str, self._esc, self._close_pos = False, False, 0
        self._started = False  # incremental: the start went out before the closing tag
        # The arguments object is the body's only depth-2 container (the name is a string).
        self._args_start: int | None = None
        self._args_end: int | None = None
        self._args_sent = 0

    def feed(self, delta: str) -> list[Event]:
        if self.is_finished:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        if self.is_finished:
            raise RuntimeError("finish() called twice")
        self.is_finished = True
        self._run(final=True)
        if self._in_call:  # the output ended inside a candidate
            self._abandon()
        if not self._after_call:  # trailing whitespace of content is content
            self._emit_content(self._ws)
        self._ws = ""
        return self._take()

    def _run(self, final: bool) -> None:
        while self._buf and (self._scan_call() if self._in_call else self._scan_text(final)):
            pass

    def _scan_text(self, final: bool) -> bool:
        buf = self._buf
        i = buf.find(TOOL_CALL_OPEN)
        if i >= 0:
            self._content(buf[:i])
            self._buf = buf[i + len(TOOL_CALL_OPEN) :]
            self._new_candidate(self._ws)
            self._in_call, self._ws = True, ""
            return True
        keep = 0 if final else partial_tag_length(buf, TOOL_CALL_OPEN)
        self._content(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep :]
        return False

    def _scan_call(self) -> bool:
        buf, base = self._buf, len(self._cand)
        for pos, ch in enumerate(buf):
            verdict = self._step(ch, base + pos, buf)
            if verdict is not None:
                cut = pos + (verdict is _DONE)  # a deviating character is scanned again
                self._cand += buf[:cut]
                self._buf = buf[cut:]
                self._send_args()
                self._complete() if verdict is _DONE else self._abandon()
                return True
        self._cand += buf
        self._buf = ""
        self._send_args()
        return False

    def _step(self, ch: str, idx: int, buf: str) -> str | None:
        """Advance the body scanner by one character at candidate offset `idx`."""
        if self._phase is _PRE:
            if ch not in _WS and ch != "{":
                return _DEVIATE
            if ch == "{":
                self._stack.append(ch)
                self._phase = _OBJ
        elif self._phase is _POST:
            if ch == TOOL_CALL_CLOSE[self._close_pos]:
                self._close_pos += 1
                return _DONE if self._close_pos == len(TOOL_CALL_CLOSE) else None
            return None if self._close_pos == 0 and ch in _WS else _DEVIATE
        elif self._in_str:
            if ch < " ":  # JSON strings hold no raw control characters
                return _DEVIATE
            self._in_str = self._esc or ch != '"'
            self._esc = not self._esc and ch == "\\"
        elif self._started and self._args_end is not None and ch not in _WS + "}":
            return _DEVIATE  # a started call allows nothing after its arguments but `}`
        elif ch == '"':
            self._in_str = True
        elif ch in "{[":
            self._stack.append(ch)
            if len(self._stack) == 2 and self._args_start is None:
                self._args_start = idx
                if ch == "{" and self.stream_arguments:
                    self._try_start(self._cand + buf[: idx - len(self._cand)])
        elif ch in _CLOSERS:
            if self._stack[-1] != _CLOSERS[ch]:
                return _DEVIATE
            self._stack.pop()
            if len(self._stack) == 1 and self._args_end is None:
                self._args_end = idx + 1
            if not self._stack:
                self._phase = _POST
        return None

    def _try_start(self, head: str) -> None:
        """Incremental: start the call if the body so far is `{"name": <known>, "arguments": `."""
        match = _HEAD.fullmatch(head)
        try:
            name = json.loads(match.group(1)) if match else None
        except ValueError:
            return
        if self._is_known(name):
            self._out.append(ToolCallStart(self.num_calls, self.make_call_id(), name))
            self._started = True
            self._args_sent = self._args_start or 0

    def _send_args(self) -> None:
        end = self._args_end if self._args_end is not None else len(self._cand)
        if self._started and end > self._args_sent:
            self._out.append(ToolCallArgsDelta(self.num_calls, self._cand[self._args_sent : end]))
            self._args_sent = end

    def _complete(self) -> None:
        """The closing tag arrived: emit the call, or give its text back as content."""
        call = self._check(self._cand[: -len(TOOL_CALL_CLOSE)])
        if self._started:
            if call is None:
                self.broken_call_indices.append(self.num_calls)
        elif call is None:
            return self._abandon()
        else:
            self._out.append(ToolCallStart(self.num_calls, self.make_call_id(), call[0]))
            self._out.append(ToolCallArgsDelta(self.num_calls, call[1]))
        self._end_call()

    def _abandon(self) -> None:
        """The candidate cannot become a call: its text is content (a call already started is
        broken instead: its text is dropped). Unconsumed input is scanned again as text."""
        if self._started:
            self.broken_call_indices.append(self.num_calls)
            return self._end_call()
        self._in_call = False
        self._ws = self._pre_ws
        self._content(TOOL_CALL_OPEN + self._cand)
        self._new_candidate("")

    def _end_call(self) -> None:
        self.num_calls += 1
        self._in_call, self._ws, self._after_call = False, "", True
        self._new_candidate("")

    def _check(self, body: str) -> tuple[str, str] | None:
        """(name, exact arguments text) of a well-formed call body, else None."""
        call = _load_call(body)
        if not (isinstance(call, dict) and call.keys() == {"name", "arguments"}):
            return None
        if not self._is_known(call["name"]) or not isinstance(call["arguments"], dict):
            return None
        # A string name and an object: the scanner's one depth-2 span is the arguments' text.
        return call["name"], self._cand[self._args_start : self._args_end]

    def _is_known(self, name: Any) -> bool:
        is_name = isinstance(name, str) and name != ""  # checked first: dicts are unhashable
        return is_name and (self.tool_names is None or name in self.tool_names)

    def _content(self, text: str) -> None:
        """Emit content, holding a trailing whitespace run (it may precede a call)."""
        combined = self._ws + text
        body = combined.strip(_WS)
        if not body:
            self._ws = combined
            return
        lead = combined[: len(combined) - len(combined.lstrip(_WS))]
        if self._after_call and not self._has_content:
            lead = ""  # whitespace after a call must not start the content
        self._emit_content(lead + body)
        self._ws = combined[len(combined.rstrip(_WS)) :]
        self._after_call = False

    def _emit_content(self, text: str) -> None:
        if not text:
            return
        self._has_content = True
        if self._out and isinstance(self._out[-1], ContentDelta):
            self._out[-1] = ContentDelta(self._out[-1].text + text)
        else:
            self._out.append(ContentDelta(text))

    def _take(self) -> list[Event]:
        out, self._out = self._out, []
        return out
