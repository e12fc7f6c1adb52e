"""Reasoning parser: `<think>...</think>` text goes to `reasoning_content`, the rest to `content`.

One instance per request, fed its text deltas in token order. Each `feed` returns a
`ReasoningChunk(reasoning, content)`: reasoning always comes before content and never resumes
once content has started, so the pair keeps the stream's order. `parse(text)` runs a fresh
instance over the whole text, so the non-streamed split is what any chunking streams. A tag
split across deltas (or a partial tag) is held back until decided.

Modes, per request:
- disabled: everything is content, verbatim. With thinking off the chat template pre-fills an
  empty `<think>\\n\\n</think>\\n\\n`, so the output carries no reasoning of its own; a stray
  tag is the model's text and is passed on as such.
- enabled: the output may open with `<think>` (after optional whitespace); if it does, the
  reasoning runs to the first `</think>`, else the whole output is content, verbatim.
- enabled and `starts_in_reasoning` (the prompt ends inside an open `<think>`, as templates
  that pre-fill the tag do; see `prompt_opens_reasoning`): reasoning from the first character.
Reasoning is trimmed of surrounding whitespace (the template renders it back as
`<think>\\n...\\n</think>\\n\\n`) and whitespace right after `</think>` is dropped. An output
that ends inside the reasoning (max_tokens) is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from serve_app.parsers.tools import partial_tag_length

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_WS = " \t\r\n"


@dataclass(frozen=True)
class ReasoningChunk:
    reasoning: str = ""
    content: str = ""


class _State(Enum):
    START = "start"  # not yet known whether the output opens with <think>
    REASONING = "reasoning"
    AFTER = "after"  # just after </think>: dropping whitespace
    CONTENT = "content"


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the prompt ends inside an open think block, so the output starts in it."""
    return prompt.rstrip(_WS).endswith(THINK_OPEN)


class ThinkReasoningParser:
    name = "think"
    version = "1"

    def __init__(self, enabled: bool = True, *, starts_in_reasoning: bool = False) -> None:
        self.enabled = enabled
        self.starts_in_reasoning = starts_in_reasoning
        if not enabled:
            self._state = _State.CONTENT
        else:
            self._state = _State.REASONING if starts_in_reasoning else _State.START
        self._buf = ""  # input not consumed yet
        self._ws = ""  # a trailing whitespace run of reasoning: dropped if the reasoning ends
        self._has_reasoning = False
        self.is_finished = False

    @classmethod
    def for_prompt(cls, prompt: str, enabled: bool = True) -> ThinkReasoningParser:
        return cls(enabled, starts_in_reasoning=enabled and prompt_opens_reasoning(prompt))

    @property
    def in_reasoning(self) -> bool:
        """True while the output may still be reasoning (its end not yet seen)."""
        return self._state in (_State.START, _State.REASONING)

    def feed(self, delta: str) -> ReasoningChunk:
        if self.is_finished:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> ReasoningChunk:
        if self.is_finished:
            raise RuntimeError("finish() called twice")
        self.is_finished = True
        chunk = self._run(final=True)
        self._ws = ""  # trailing whitespace of unterminated reasoning is trimmed
        return chunk

    def parse(self, text: str) -> ReasoningChunk:
        """The whole output at once, on fresh state (this instance's stream is untouched)."""
        parser = ThinkReasoningParser(self.enabled, starts_in_reasoning=self.starts_in_reasoning)
        first, last = parser.feed(text), parser.finish()
        return ReasoningChunk(first.reasoning + last.reasoning, first.content + last.content)

    def _run(self, final: bool) -> ReasoningChunk:
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            buf = self._buf
            if self._state is _State.START:
                opening = buf.lstrip(_WS)
                if opening.startswith(THINK_OPEN):
                    self._buf = opening[len(THINK_OPEN) :]
                    self._state = _State.REASONING
                elif not final and THINK_OPEN.startswith(opening):
                    break  # only whitespace or a partial `<think>` so far
                else:
                    self._state = _State.CONTENT  # the leading whitespace stays content
            elif self._state is _State.REASONING:
                end = buf.find(THINK_CLOSE)
                if end >= 0:
                    reasoning.append(self._reasoning(buf[:end]))
                    self._buf, self._ws = buf[end + len(THINK_CLOSE) :], ""
                    self._state = _State.AFTER
                    continue
                keep = 0 if final else partial_tag_length(buf, THINK_CLOSE)
                reasoning.append(self._reasoning(buf[: len(buf) - keep]))
                self._buf = buf[len(buf) - keep :]
                break
            elif self._state is _State.AFTER:
                self._buf = buf.lstrip(_WS)
                if self._buf:
                    self._state = _State.CONTENT
            else:
                content.append(buf)
                self._buf = ""
        return ReasoningChunk("".join(reasoning), "".join(content))

    def _reasoning(self, text: str) -> str:
        """Reasoning text to emit now, trimmed: leading whitespace dropped, trailing held."""
        combined = self._ws + text
        if not self._has_reasoning:
            combined = combined.lstrip(_WS)
        body = combined.rstrip(_WS)
        self._ws = combined[len(body) :]
        self._has_reasoning = self._has_reasoning or bool(body)
        return body
