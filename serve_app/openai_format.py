"""Engine outputs -> OpenAI bodies and stream chunks, one accumulator per choice."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.messages import TokenLogprobs
from actors.outputs import CompletionDelta
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
from serve_app.token_text import TokenTexts


@dataclass
class ChoiceState:
    index: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, delta: CompletionDelta) -> None:
        self.text += delta.text
        self.num_tokens += len(delta.token_ids)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish(delta.finish_reason.value, delta.stop_reason)

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.finish_reason, self.stop_reason = openai_finish_reason(reason, stop_reason)


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


@dataclass
class Formatter:
    """Builds one endpoint's bodies; `chat` picks the chat or the completions shapes."""

    chat: bool
    response_id: str
    model: str
    fingerprint: str
    texts: TokenTexts
    want_logprobs: bool

    def body(self, choices: list[ChoiceState], usage: Usage, echo: list[str]) -> dict:
        if self.chat:
            return ChatCompletionResponse(
                id=self.response_id,
                model=self.model,
                choices=[
                    ChatChoice(
                        index=c.index,
                        message=ChatResponseMessage(content=c.text),
                        logprobs=(
                            chat_logprobs(self.texts, c.token_ids, c.logprobs)
                            if self.want_logprobs
                            else None
                        ),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                    for c in choices
                ],
                usage=usage,
                system_fingerprint=self.fingerprint,
            ).to_dict()
        return CompletionResponse(
            id=self.response_id,
            model=self.model,
            choices=[
                CompletionChoice(
                    index=c.index,
                    text=echo[c.index] + c.text,
                    logprobs=(
                        completion_logprobs(self.texts, c.token_ids, c.logprobs, len(echo[c.index]))
                        if self.want_logprobs
                        else None
                    ),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in choices
            ],
            usage=usage,
            system_fingerprint=self.fingerprint,
        ).to_dict()

    def role_chunk(self, index: int) -> dict:
        choice = ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
        return self._chunk([choice])

    def content_chunk(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        logprobs: list[TokenLogprobs] | None,
        offset: int,
    ) -> dict:
        if self.chat:
            lp = chat_logprobs(self.texts, token_ids, logprobs) if logprobs else None
            choice = ChatChunkChoice(index=index, delta=DeltaMessage(content=text), logprobs=lp)
            return self._chunk([choice])
        clp = completion_logprobs(self.texts, token_ids, logprobs, offset) if logprobs else None
        return self._chunk([CompletionChoice(index=index, text=text, logprobs=clp)])

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

    def _chunk(self, choices: list, usage: Usage | None = None) -> dict:
        cls = ChatCompletionChunk if self.chat else CompletionChunk
        return cls(
            id=self.response_id,
            model=self.model,
            choices=choices,
            usage=usage,
            system_fingerprint=self.fingerprint,
        ).to_dict()
