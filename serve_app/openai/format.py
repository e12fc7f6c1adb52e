"""Engine outputs -> OpenAI bodies and stream chunks, one accumulator per choice."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from actors.messages import TokenLogprobs
from actors.outputs import CompletionDelta
from serve_app.openai.streaming import ChunkFrames
from serve_app.openai.token_text import TokenTexts
from serve_app.parsers.chat_output import ChoiceMessage, ChoiceParser, OutputEvent, ReasoningDelta
from serve_app.parsers.tools import ContentDelta, ToolCallStart
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
    FunctionCall,
    ToolCallOut,
    Usage,
    openai_finish_reason,
)
from serve_app.protocol.responses import PromptLogprob, PromptLogprobs, clamp_logprob, now


@dataclass
class ChoiceState:
    index: int
    text: str = ""  # the generated text, verbatim
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # Chat: reads reasoning and tool calls out of the text; None: all of it is content.
    parser: ChoiceParser | None = None
    message: ChoiceMessage = field(default_factory=ChoiceMessage)

    def add(self, delta: CompletionDelta) -> list[OutputEvent]:
        """Take one engine delta; return what it adds to the message, in order."""
        self.text += delta.text
        self.num_tokens += len(delta.token_ids)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if self.parser is None:
            events: list[OutputEvent] = [ContentDelta(delta.text)] if delta.text else []
        else:
            events = self.parser.feed(delta.text)
        self._record(events)
        if delta.finish_reason is not None:
            events += self.finish(delta.finish_reason.value, delta.stop_reason)
        return events

    def finish(self, reason: str, stop_reason: str | int | None = None) -> list[OutputEvent]:
        """End the choice: release what the parser held back, then set the finish reason."""
        events = self.parser.finish() if self.parser is not None else []
        self._record(events)
        self.finish_reason, self.stop_reason = openai_finish_reason(reason, stop_reason)
        if self.finish_reason == "stop" and self.num_tool_calls:
            self.finish_reason = "tool_calls"
        return events

    @property
    def broken_call_indices(self) -> list[int]:
        return self.parser.broken_call_indices if self.parser is not None else []

    @property
    def num_tool_calls(self) -> int:
        """Well-formed calls (a call cut short is counted out)."""
        return len(self.message.tool_calls) - len(self.broken_call_indices)

    def _record(self, events: list[OutputEvent]) -> None:
        for event in events:
            self.message.add(event)


def chat_logprobs(
    texts: TokenTexts, token_ids: list[int], logprobs: list[TokenLogprobs]
) -> ChatLogprobs:
    content = []
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        text, raw = texts.get(token_id)
        top = [(texts.get(t)[0], v) for t, v in lp.top]
        content.append(ChatTokenLogprob.build(text, lp.logprob, top, token_bytes=raw))
    return ChatLogprobs(content=content)


def completion_logprobs(
    texts: TokenTexts, token_ids: list[int], logprobs: list[TokenLogprobs], offset: int
) -> CompletionLogprobs:
    tokens = [texts.get(t)[0] for t in token_ids]
    top = [[(texts.get(t)[0], v) for t, v in lp.top] for lp in logprobs]
    return CompletionLogprobs.build(tokens, [lp.logprob for lp in logprobs], top, offset)


def prompt_logprobs_field(
    texts: TokenTexts, prompt_ids: list[int], logprobs: list[TokenLogprobs | None], k: int
) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: per prompt token, its own candidate and the top-k."""
    wire: PromptLogprobs = []
    for token_id, lp in zip(prompt_ids, logprobs, strict=True):
        if lp is None:
            wire.append(None)
            continue
        entry = {str(token_id): _candidate(texts, token_id, lp.logprob, lp.rank)}
        for rank, (alt, value) in enumerate(lp.top[:k], start=1):
            entry.setdefault(str(alt), _candidate(texts, alt, value, rank))
        wire.append(entry)
    return wire


def _candidate(texts: TokenTexts, token_id: int, logprob: float, rank: int) -> PromptLogprob:
    return PromptLogprob(
        logprob=clamp_logprob(logprob), rank=rank, decoded_token=texts.get(token_id)[0]
    )


def echoed_logprobs(
    texts: TokenTexts,
    prompt_ids: list[int],
    logprobs: list[TokenLogprobs | None],
    k: int,
    echo_len: int,
) -> CompletionLogprobs:
    """The echoed prompt's part of a completions `logprobs` object (OpenAI's legacy echo):
    the first token has no logprob and no alternatives (null). Offsets index the echoed text
    (`echo_len` characters): its tokens' texts are aligned to end where it ends, so tokens
    the tokenizer added before the text (a BOS) sit at 0."""
    tokens = [texts.get(t)[0] for t in prompt_ids]
    shift = max(0, sum(len(t) for t in tokens) - echo_len)
    starts = itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if lp is None else clamp_logprob(lp.logprob) for lp in logprobs],
        top_logprobs=[
            None
            if lp is None
            else {texts.get(t)[0]: clamp_logprob(value) for t, value in lp.top[:k]}
            for lp in logprobs
        ],
        text_offset=[max(0, start - shift) for start in starts],
    )


def joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        text_offset=first.text_offset + then.text_offset,
    )


def chat_message(message: ChoiceMessage, broken: list[int]) -> ChatResponseMessage:
    """The non-streamed message. A call cut short (max_tokens, deadline) is left out: a
    client never receives a call it cannot parse (a stream cannot retract one it began)."""
    calls = [
        ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments_json))
        for i, c in enumerate(message.tool_calls)
        if i not in broken
    ]
    return ChatResponseMessage(
        # OpenAI sends null content beside tool calls when the model wrote nothing else.
        content=message.content if message.content or not calls else None,
        reasoning_content=message.reasoning or None,
        tool_calls=calls or None,
    )


def event_delta(event: OutputEvent) -> dict[str, Any]:
    """A parser event as a chunk's `delta`, in `DeltaMessage`'s wire form (built as a dict:
    this runs per token, and a pydantic round trip costs several times the rest)."""
    if isinstance(event, ContentDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, ToolCallStart):
        # The whole name, once, before any argument fragment.
        function = {"name": event.name, "arguments": ""}
        call = {"index": event.index, "id": event.id, "type": "function", "function": function}
    else:
        call = {"index": event.index, "function": {"arguments": event.fragment}}
    return {"tool_calls": [call]}


@dataclass
class Formatter:
    """Builds one endpoint's bodies; `chat` picks the chat or the completions shapes."""

    chat: bool
    response_id: str
    model: str
    fingerprint: str
    texts: TokenTexts
    want_logprobs: bool
    # `return_token_ids`: generated ids per choice and the prompts' ids (one per prompt; a
    # choice's prompt is `prompt_ids[index // n]`).
    want_token_ids: bool = False
    prompt_ids: list[list[int]] = field(default_factory=list)
    n: int = 1
    # Top-k counts of the `prompt_logprobs` field and of a completions echo with logprobs
    # (None: not asked), and the engine's prompt logprobs per prompt (from its first output).
    prompt_top: int | None = None
    echo_top: int | None = None
    prompt_logprobs: list[list[TokenLogprobs | None] | None] = field(default_factory=list)
    # One value for every chunk of the stream, as OpenAI sends it.
    created: int = field(default_factory=now)

    @cached_property
    def frames(self) -> ChunkFrames:
        """The stream's chunk envelope, serialized once for its per-token chunks."""
        return ChunkFrames(self._chunk([]))

    def _ids(self, token_ids: list[int]) -> list[int] | None:
        return list(token_ids) if self.want_token_ids else None

    def prompt_of(self, index: int) -> list[int] | None:
        return list(self.prompt_ids[index // self.n]) if self.want_token_ids else None

    def _engine_prompt_logprobs(self, index: int) -> list[TokenLogprobs | None] | None:
        prompt = index // self.n
        return self.prompt_logprobs[prompt] if prompt < len(self.prompt_logprobs) else None

    def prompt_logprobs_of(self, index: int) -> PromptLogprobs | None:
        """The `prompt_logprobs` field of choice `index` (chat: of the response)."""
        lps = self._engine_prompt_logprobs(index)
        if self.prompt_top is None or lps is None:
            return None
        prompt_ids = self.prompt_ids[index // self.n]
        return prompt_logprobs_field(self.texts, prompt_ids, lps, self.prompt_top)

    def _echoed(self, index: int, echo: str) -> CompletionLogprobs | None:
        lps = self._engine_prompt_logprobs(index)
        if self.echo_top is None or lps is None:
            return None
        prompt_ids = self.prompt_ids[index // self.n]
        return echoed_logprobs(self.texts, prompt_ids, lps, self.echo_top, len(echo))

    def _completion_logprobs(self, c: ChoiceState, echo: str) -> CompletionLogprobs | None:
        if not self.want_logprobs:
            return None
        generated = completion_logprobs(self.texts, c.token_ids, c.logprobs, len(echo))
        echoed = self._echoed(c.index, echo)
        return generated if echoed is None else joined(echoed, generated)

    def body(self, choices: list[ChoiceState], usage: Usage, echo: list[str]) -> dict:
        if self.chat:
            return ChatCompletionResponse(
                id=self.response_id,
                model=self.model,
                choices=[
                    ChatChoice(
                        index=c.index,
                        message=chat_message(c.message, c.broken_call_indices),
                        logprobs=(
                            chat_logprobs(self.texts, c.token_ids, c.logprobs)
                            if self.want_logprobs
                            else None
                        ),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        token_ids=self._ids(c.token_ids),
                    )
                    for c in choices
                ],
                usage=usage,
                system_fingerprint=self.fingerprint,
                prompt_token_ids=self.prompt_of(0),
                prompt_logprobs=self.prompt_logprobs_of(0),
            ).to_dict()
        return CompletionResponse(
            id=self.response_id,
            model=self.model,
            choices=[
                CompletionChoice(
                    index=c.index,
                    text=echo[c.index] + c.text,
                    logprobs=self._completion_logprobs(c, echo[c.index]),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=self._ids(c.token_ids),
                    prompt_token_ids=self.prompt_of(c.index),
                    prompt_logprobs=self.prompt_logprobs_of(c.index),
                )
                for c in choices
            ],
            usage=usage,
            system_fingerprint=self.fingerprint,
        ).to_dict()

    def role_chunk(self, index: int) -> dict:
        choice = ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
        # The prompt's ids ride on the stream's first chunk.
        return self._chunk([choice], prompt_token_ids=self.prompt_of(0) if index == 0 else None)

    def echo_chunk(self, index: int, text: str) -> dict:
        """A completions choice's first chunk: the echoed prompt (with its logprobs when
        asked, as vLLM streams them) and the prompt's ids when asked."""
        item = CompletionChoice(
            index=index,
            text=text,
            logprobs=self._echoed(index, text),
            token_ids=self._ids([]),
            prompt_token_ids=self.prompt_of(index),
        )
        return self._chunk([item])

    def stream_logprobs(self, parts: list[tuple[CompletionDelta, int]]) -> dict | None:
        """One chunk's wire `logprobs`: its engine deltas' (each with the text offset it
        starts at), joined in order; None when there are none."""
        if not parts:
            return None
        if self.chat:
            ids = [t for delta, _ in parts for t in delta.token_ids]
            lps = [lp for delta, _ in parts for lp in delta.logprobs or []]
            return chat_logprobs(self.texts, ids, lps).to_dict()
        built = [
            completion_logprobs(self.texts, delta.token_ids, delta.logprobs or [], offset)
            for delta, offset in parts
        ]
        return functools.reduce(joined, built).to_dict()

    def text_choice(
        self, index: int, text: str, token_ids: list[int], logprobs: dict | None
    ) -> dict:
        """A completions content chunk's choice, in `CompletionChoice`'s wire form."""
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": None,
            "stop_reason": None,
        }
        if self.want_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def event_choices(
        self, index: int, events: list[OutputEvent], token_ids: list[int], logprobs: dict | None
    ) -> list[dict]:
        """Chat: one chunk choice per event, in `ChatChunkChoice`'s wire form; the engine
        deltas' logprobs and token ids ride on the first (or on a choice of their own when
        the parsers held all of their text back)."""
        ids = self._ids(token_ids) if token_ids else None
        deltas = [event_delta(e) for e in events] or ([{}] if logprobs or ids else [])
        choices = []
        for i, delta in enumerate(deltas):
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": logprobs if i == 0 else None,
                "finish_reason": None,
                "stop_reason": None,
            }
            if i == 0 and ids is not None:
                choice["token_ids"] = ids
            choices.append(choice)
        return choices

    def finish_chunk(self, choice: ChoiceState) -> dict:
        if self.chat:
            item = ChatChunkChoice(
                index=choice.index,
                delta=DeltaMessage(),
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
            )
        else:
            item = CompletionChoice(
                index=choice.index,
                text="",
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
            )
        return self._chunk([item])

    def usage_chunk(self, usage: Usage) -> dict:
        return self._chunk([], usage)

    def _chunk(
        self, choices: list, usage: Usage | None = None, prompt_token_ids: list[int] | None = None
    ) -> dict:
        common = {"id": self.response_id, "created": self.created, "model": self.model}
        common.update(choices=choices, usage=usage, system_fingerprint=self.fingerprint)
        if self.chat:
            return ChatCompletionChunk(**common, prompt_token_ids=prompt_token_ids).to_dict()
        return CompletionChunk(**common).to_dict()
