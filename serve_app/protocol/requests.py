"""OpenAI-compatible request models: /v1/chat/completions and /v1/completions."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from serve_app import errors
from serve_app.grammar.spec import GrammarSpec
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


# `ChatMessage._check_role_fields` as JSON Schema, so the published contract (/openapi.json)
# states the same rules the validator enforces.
_GIVEN_CONTENT = {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}
_ROLE_RULES: dict[str, Any] = {
    "allOf": [
        {
            "if": {"properties": {"role": {"const": "assistant"}}},
            "then": {
                "anyOf": [
                    _GIVEN_CONTENT,
                    {
                        "required": ["tool_calls"],
                        "properties": {"tool_calls": {"type": "array", "minItems": 1}},
                    },
                ]
            },
            "else": {
                "required": ["content"],
                "properties": {
                    "content": {"not": {"type": "null"}},
                    "tool_calls": {"type": "null"},
                },
            },
        },
        {
            "if": {"properties": {"role": {"const": "tool"}}},
            "then": {
                "required": ["tool_call_id"],
                "properties": {"tool_call_id": {"type": "string", "minLength": 1}},
            },
            "else": {"properties": {"tool_call_id": {"type": "null"}}},
        },
    ]
}


class ChatMessage(StrictModel):
    model_config = {**StrictModel.model_config, "json_schema_extra": _ROLE_RULES}

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
    # Checked by serve_app.grammar.tools (shapes, names, schemas that compile).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Extension: the constrained answer must follow a reasoning block the mask enforces.
    strict_thinking: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _policy(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = apply_parameter_policy(data, {"echo": "echo is not supported for chat completions"})
        _reject_non_text_parts(data.get("messages"))
        return data

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_enable_thinking(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # The template tests `enable_thinking is false`: any other value would silently
        # read as unset, so only a boolean (or null) is taken.
        thinking = (value or {}).get("enable_thinking")
        if thinking is not None and not isinstance(thinking, bool):
            raise errors.invalid_request(
                "'chat_template_kwargs.enable_thinking' must be true or false.",
                "chat_template_kwargs.enable_thinking",
            )
        return value

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
        self._check_tools()
        self._check_thinking()
        return self

    def _check_tools(self) -> None:
        from serve_app.grammar.tools import ToolSpecError, validate_tools

        try:
            validate_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ToolSpecError as exc:
            message = f"Invalid value for '{exc.param}': {exc.reason}."
            if exc.code == "invalid_grammar":
                raise errors.invalid_grammar(message, exc.param) from None
            if exc.code == "request_limit_exceeded":  # the reason is the whole message
                raise errors.APIError(400, exc.code, exc.reason, param=exc.param) from None
            raise errors.invalid_request(message, exc.param) from None
        if self.tool_choice_mode in ("required", "named") and super().has_grammar():
            raise errors.invalid_request(
                "'tool_choice' that forces a call cannot be combined with 'response_format' "
                "or 'structured_outputs'.",
                "tool_choice",
            )

    def _check_thinking(self) -> None:
        if not self.strict_thinking:
            return
        if self.thinking is False:
            raise errors.invalid_request(
                "'strict_thinking' needs thinking enabled (chat_template_kwargs.enable_thinking).",
                "strict_thinking",
            )
        if not self.has_grammar():
            raise errors.invalid_request(
                "'strict_thinking' applies to a constrained answer: give 'response_format', "
                "'structured_outputs', or a 'tool_choice' that forces a call.",
                "strict_thinking",
            )

    # ------------------------------------------------------------ tools, reasoning

    @property
    def tool_choice_mode(self) -> Literal["none", "auto", "required", "named"]:
        """OpenAI's default is `auto` with tools and `none` without."""
        choice = self.tool_choice
        if choice is None:
            return "auto" if self.tools else "none"
        if isinstance(choice, dict):
            return "named"
        return choice  # type: ignore[return-value]  # validate_tools checked the value

    @property
    def thinking(self) -> bool | None:
        """`chat_template_kwargs.enable_thinking`: None when not given."""
        value = (self.chat_template_kwargs or {}).get("enable_thinking")
        return value if isinstance(value, bool) else None

    def has_grammar(self) -> bool:
        return self.tool_choice_mode in ("required", "named") or super().has_grammar()

    def _build_grammar_spec(self) -> GrammarSpec | None:
        if self.tool_choice_mode in ("required", "named"):
            from serve_app.grammar.tools import tool_call_grammar

            return tool_call_grammar(self.tools, self.tool_choice, self.parallel_tool_calls)
        return super()._build_grammar_spec()

    def grammar_param(self) -> str | None:
        if self.tool_choice_mode in ("required", "named"):
            return "tool_choice"
        return super().grammar_param()

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
# Chat fields that change output, which a completions request cannot use.
COMPLETION_ONLY = {
    name: "tool calling is only available on /v1/chat/completions"
    for name in ("tools", "tool_choice", "parallel_tool_calls")
}


class CompletionRequest(SamplingRequest):
    kind: ClassVar[Literal["completion"]] = "completion"

    prompt: Prompt
    # Completions semantics: how many top alternatives to return per token.
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _policy(cls, data: Any) -> Any:
        return apply_parameter_policy(data, COMPLETION_ONLY) if isinstance(data, dict) else data

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

    @property
    def echoes_logprobs(self) -> bool:
        """`echo` with `logprobs`: the echoed prompt's tokens come with their logprobs."""
        return bool(self.echo) and self.logprobs is not None

    def requested_prompt_logprobs(self) -> int | None:
        # The engine computes the larger top-k; each field reports its own count.
        counts = [self.prompt_logprobs, self.logprobs if self.echoes_logprobs else None]
        given = [k for k in counts if k is not None]
        return max(given) if given else None
