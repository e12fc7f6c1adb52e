"""OpenAI-compatible response bodies and stream chunks (typed; `.to_dict()` is the wire form)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from serve_app import outcomes

# OpenAI reports "practically impossible" tokens as -9999.0; JSON has no -Infinity.
MIN_LOGPROB = -9999.0


def openai_finish_reason(
    finish_reason: str, stop_reason: str | int | None = None
) -> tuple[str, str | int | None]:
    """Map an engine outcome to OpenAI's (`finish_reason`, `stop_reason`), as the outcome
    table (`serve_app.outcomes`) says; an engine failure has none (ValueError)."""
    reason = outcomes.openai_finish(finish_reason)
    if reason is None:
        raise ValueError(f"no OpenAI finish reason for {finish_reason!r}")
    return reason, stop_reason


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def clamp_logprob(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class WireModel(BaseModel):
    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


# Extension fields (vLLM's `return_token_ids`, `prompt_logprobs`) that appear only when the
# request asked.
_TOKEN_ID_FIELDS = ("token_ids", "prompt_token_ids", "prompt_logprobs")


class WithTokenIds(WireModel):
    @model_serializer(mode="wrap")
    def _token_ids_when_asked(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in _TOKEN_ID_FIELDS:
            if data.get(name, 0) is None:
                del data[name]
        return data


# -------------------------------------------------------------------------- usage


class PromptTokensDetails(WireModel):
    cached_tokens: int = 0


class Usage(WireModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        # Cached tokens are part of prompt_tokens, never added on top.
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


# ----------------------------------------------------------------- chat logprobs


class TopLogprob(WireModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(WireModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)

    @classmethod
    def build(
        cls,
        token: str,
        logprob: float,
        top: Sequence[tuple[str, float]] = (),
        token_bytes: bytes | None = None,
    ) -> ChatTokenLogprob:
        """`token_bytes` is for tokens that are not whole UTF-8 (byte-fallback pieces)."""
        raw = token.encode("utf-8") if token_bytes is None else token_bytes
        return cls(
            token=token,
            logprob=clamp_logprob(logprob),
            bytes=list(raw),
            top_logprobs=[
                TopLogprob(token=t, logprob=clamp_logprob(lp), bytes=list(t.encode("utf-8")))
                for t, lp in top
            ],
        )


class ChatLogprobs(WireModel):
    content: list[ChatTokenLogprob] | None = None


# ------------------------------------------------------------- prompt logprobs


class PromptLogprob(WireModel):
    """vLLM's `Logprob`: one candidate at one prompt position."""

    logprob: float
    rank: int
    decoded_token: str


# Aligned with the prompt's tokens: None for the first, then {token id: candidate} holding the
# prompt's own token and the top-k alternatives (vLLM's `prompt_logprobs` shape).
PromptLogprobs = list[dict[str, PromptLogprob] | None]


# -------------------------------------------------------------- chat completion


class OnlyGiven(WireModel):
    @model_serializer(mode="wrap")
    def _only_given(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # A delta carries only what changed: `{}` on the finish chunk, as OpenAI sends it.
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCall(WireModel):
    name: str
    # The arguments object as JSON text, exactly as generated.
    arguments: str


class ToolCallOut(WireModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OnlyGiven):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OnlyGiven):
    """A call's first delta has `id`, `type` and the whole `name`; later ones only an
    argument fragment (`function.arguments`), all under the call's `index`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatResponseMessage(WireModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _calls_when_any(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # As OpenAI: `tool_calls` appears only when the model called a tool.
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatChoice(WithTokenIds):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # the generated ids, when asked


class ChatCompletionResponse(WithTokenIds):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    # The served artifact's fingerprint (weights, tokenizer, template, grammar backend).
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # the templated prompt, when asked
    prompt_logprobs: PromptLogprobs | None = None  # the templated prompt's, when asked


class DeltaMessage(OnlyGiven):
    role: Literal["assistant"] | None = None
    content: str | None = None
    # Extension (as vLLM and SGLang name it): reasoning text, on its own channel.
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(WithTokenIds):
    index: int
    delta: DeltaMessage = Field(default_factory=DeltaMessage)
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # this chunk's generated ids, when asked


class ChatCompletionChunk(WithTokenIds):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    # Only the final usage chunk (with `choices: []`) sets it.
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # on the first chunk, when asked


# ------------------------------------------------------------------ completions


class CompletionLogprobs(WireModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)

    @classmethod
    def build(
        cls,
        tokens: list[str],
        logprobs: list[float],
        top: list[list[tuple[str, float]]] | None = None,
        start_offset: int = 0,
    ) -> CompletionLogprobs:
        """`start_offset`: characters of text before these tokens (earlier chunks, echo)."""
        offsets, offset = [], start_offset
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        tops: list[dict[str, float] | None] = (
            [{t: clamp_logprob(lp) for t, lp in alts} for alts in top]
            if top is not None
            else [None] * len(tokens)
        )
        return cls(
            tokens=list(tokens),
            token_logprobs=[clamp_logprob(lp) for lp in logprobs],
            top_logprobs=tops,
            text_offset=offsets,
        )


class CompletionChoice(WithTokenIds):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # When asked: the generated ids (a stream chunk: its own), and the choice's prompt ids
    # (a stream: on the choice's first chunk).
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # the choice's prompt's, when asked


class CompletionResponse(WireModel):
    id: str
    # OpenAI uses "text_completion" for both the body and its stream chunks.
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChunk(CompletionResponse):
    """A stream chunk; `usage` is set only on the final usage chunk (`choices: []`)."""
