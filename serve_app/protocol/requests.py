"""OpenAI-compatible request models: /v1/chat/completions and /v1/completions."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from serve_app import errors
from serve_app.protocol.params import (
    MAX_COMPLETION_LOGPROBS,
    MAX_PROMPTS,
    MAX_TOP_LOGPROBS,
    SamplingRequest,
    StrictModel,
    apply_parameter_policy,
)

Role = Literal["system", "user", "assistant", "tool", "developer"]


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(StrictModel):
    name: str
    arguments: str


class ToolCall(StrictModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(StrictModel):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # Our own responses carry it, so clients echo assistant turns back with it.
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a '{self.role}' message needs 'content'")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only 'assistant' messages may carry 'tool_calls'")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs 'tool_call_id'")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("only 'tool' messages may carry 'tool_call_id'")
        return self

    @property
    def text(self) -> str:
        """The content as one string (text parts joined by newlines)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(part.text for part in self.content)


def _reject_non_text_parts(messages: Any) -> None:
    """Image, audio and file parts are known OpenAI inputs we cannot read: say so by name."""
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise errors.unsupported_parameter(
                    f"messages.{i}.content.{j}", f"content parts of type '{kind}' (text only)"
                )


class ChatCompletionRequest(SamplingRequest):
    kind: ClassVar[Literal["chat"]] = "chat"

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _policy(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = apply_parameter_policy(data, {"echo": "echo is not supported for chat completions"})
        _reject_non_text_parts(data.get("messages"))
        return data

    @model_validator(mode="after")
    def _cross_field(self) -> ChatCompletionRequest:
        mt, mct = self.max_tokens, self.max_completion_tokens
        if mt is not None and mct is not None and mt != mct:
            raise errors.invalid_request(
                "'max_tokens' and 'max_completion_tokens' differ; give one.",
                "max_completion_tokens",
            )
        if self.top_logprobs is not None and self.logprobs is not True:
            raise errors.invalid_request(
                "'top_logprobs' requires 'logprobs' to be true.", "top_logprobs"
            )
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise errors.invalid_request(
                    "'continue_final_message' and 'add_generation_prompt' exclude each other.",
                    "continue_final_message",
                )
            if self.messages[-1].role != "assistant":
                raise errors.invalid_request(
                    "'continue_final_message' needs the last of 'messages' to be 'assistant'.",
                    "messages",
                )
        self.check_common(self.requested_max_tokens())
        return self

    @property
    def wants_generation_prompt(self) -> bool:
        # Default true, except when continuing the last message (the prompt must end in it).
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        # Chat: a flag plus a top-k count; the engine's logprobs is the top-k count.
        return (self.top_logprobs or 0) if self.logprobs else None


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    kind: ClassVar[Literal["completion"]] = "completion"

    prompt: Prompt
    # Completions semantics: how many top alternatives to return per token.
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _policy(cls, data: Any) -> Any:
        return apply_parameter_policy(data) if isinstance(data, dict) else data

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Prompt) -> Prompt:
        if isinstance(value, str):
            if not value:
                raise ValueError("the prompt must be non-empty")
            return value
        if not value:
            raise ValueError("the prompt list must be non-empty")
        if len(value) > MAX_PROMPTS and not isinstance(value[0], int):
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        items = [value] if isinstance(value[0], int) else value
        for item in items:
            if not item:
                raise ValueError("each prompt must be non-empty")
            if isinstance(item, list) and any(t < 0 for t in item):
                raise ValueError("token ids must be >= 0")
        return value

    @model_validator(mode="after")
    def _cross_field(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise errors.unsupported_parameter(
                "echo", "echo with logprobs needs prompt logprobs, which are not computed"
            )
        self.check_common(self.max_tokens)
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]

    def requested_logprobs(self) -> int | None:
        return self.logprobs
