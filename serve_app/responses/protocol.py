"""The request body of `POST /v1/responses`: strict (an unknown field is a 400 naming it),
with OpenAI's known-but-unsupported fields refused by name, and its input items read into
typed items (`chat_request` restates it as the chat request the engine path admits;
`info` describes it in `/v1/server_info`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from serve_app import errors
from serve_app.protocol.parsing import from_validation_error, load_json_object

MAX_INPUT_ITEMS = 512
MAX_METADATA_KEYS = 16

# Known OpenAI fields this server does not support: refused by name unless the value
# changes nothing (null, false, empty).
UNSUPPORTED_FIELDS: dict[str, str] = {
    "include": "no additional output data (logprobs, encrypted reasoning) is available",
    "prompt": "prompt templates are not supported",
    "top_logprobs": "logprobs are not supported on /v1/responses",
    "context_management": "context management is not supported",
}
# Known OpenAI fields that change nothing here: accepted, and dropped.
IGNORED_FIELDS = (
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "safety_identifier",
    "stream_options",
    "max_tool_calls",  # bounds built-in tool calls only
)
BUILT_IN_TOOLS = "built-in tools are not available here (function tools only)"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# ----------------------------------------------------------------------- input items


class InputText(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    # An assistant message echoed back from an earlier response carries these.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningText(Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or ())


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
ITEM_MODELS: dict[str, type[Strict]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}
TEXT_PARTS = ("input_text", "output_text")


# ------------------------------------------------------------------ tools and format


class FunctionTool(Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    # NOTE: `schema` would shadow a BaseModel attribute; the alias is the wire name.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextOptions(Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class ReasoningOptions(Strict):
    # Only "not given": the model's `<think>` channel cannot be steered here.
    effort: None = None
    summary: None = None
    generate_summary: None = None


class ConversationRef(Strict):
    id: str = Field(min_length=1)


class ResponseCreate(Strict):
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "required", "none"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    truncation: Literal["disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = Field(None, min_length=1)
    # A conversation of /v1/conversations: its items come before the input, and the input
    # and output items are appended to it when the response completes.
    conversation: str | ConversationRef | None = None
    stream: bool | None = None
    background: bool | None = None

    @property
    def conversation_id(self) -> str | None:
        if isinstance(self.conversation, ConversationRef):
            return self.conversation.id
        return self.conversation

    def items(self) -> list[InputItem]:
        """The input as typed items (a string is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        if len(self.input) > MAX_INPUT_ITEMS:
            raise errors.invalid_request(f"at most {MAX_INPUT_ITEMS} input items", "input")
        return [parse_item(raw, f"input.{i}") for i, raw in enumerate(self.input)]

    @property
    def format_type(self) -> str:
        fmt = self.text.format if self.text is not None else None
        return "text" if fmt is None else fmt.type


def parse_body(body: bytes) -> ResponseCreate:
    data = load_json_object(body)
    data = apply_policy(data)
    try:
        req = ResponseCreate.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, data) from None
    check_metadata(req.metadata)
    if req.conversation_id is not None and req.previous_response_id is not None:
        raise errors.invalid_request(
            "Name either a conversation or a previous_response_id, not both: each is the "
            "context the input continues.",
            "conversation",
        )
    if req.conversation_id == "":
        raise errors.invalid_request("Invalid 'conversation': an empty id.", "conversation")
    if req.conversation_id is not None and not req.store:
        raise errors.invalid_request(
            "A response in a conversation must be stored (store: true): its items are added "
            "to the conversation.",
            "store",
        )
    if req.background and not req.store:
        raise errors.invalid_request(
            "A background response must be stored (store: true): it is polled, cancelled and "
            "resumed by its id.",
            "background",
        )
    return req


def apply_policy(data: dict[str, Any]) -> dict[str, Any]:
    """Drop the fields that change nothing; refuse the known ones that would, by name."""
    kept = {}
    for name, value in data.items():
        if name in IGNORED_FIELDS:
            continue
        if name in UNSUPPORTED_FIELDS:
            if value is None or value is False or value == [] or value == 0:
                continue
            raise errors.unsupported_parameter(name, UNSUPPORTED_FIELDS[name])
        kept[name] = value
    if data.get("truncation") == "auto":
        raise errors.unsupported_parameter(
            "truncation",
            "'auto' is not supported: an input over the context is refused (400 "
            "context_length_exceeded, naming the budget), never cut",
        )
    reasoning = data.get("reasoning")
    for key, value in reasoning.items() if isinstance(reasoning, dict) else ():
        if key in ReasoningOptions.model_fields and value is not None:
            raise errors.unsupported_parameter(
                f"reasoning.{key}",
                "the model's <think> channel is returned as reasoning items as written; it "
                "cannot be steered or summarized here",
            )
    tools = data.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise errors.unsupported_parameter(f"tools.{i}.type", f"'{kind}': {BUILT_IN_TOOLS}")
    choice = data.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") not in (None, "function"):
        raise errors.unsupported_parameter(
            "tool_choice.type", f"'{errors.echo(str(choice.get('type')))}': {BUILT_IN_TOOLS}"
        )
    return kept


def parse_item(raw: Any, where: str) -> InputItem:
    if not isinstance(raw, dict):
        raise errors.invalid_request(f"Invalid value for '{where}': an item is an object.", where)
    kind = raw.get("type", "message" if "role" in raw else None)
    model = ITEM_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        if isinstance(kind, str):
            raise errors.unsupported_parameter(
                f"{where}.type",
                f"input items of type '{errors.echo(kind)}' (message, function_call, "
                "function_call_output and reasoning only)",
            )
        raise errors.invalid_request(f"Missing required parameter: '{where}.type'.", where)
    parts = raw.get("content") if kind == "message" else raw.get("output")
    for j, part in enumerate(parts if isinstance(parts, list) else ()):
        ptype = part.get("type") if isinstance(part, dict) else None
        if isinstance(ptype, str) and ptype not in TEXT_PARTS:
            field = "content" if kind == "message" else "output"
            raise errors.unsupported_parameter(
                f"{where}.{field}.{j}", f"content parts of type '{errors.echo(ptype)}' (text only)"
            )
    try:
        return model.model_validate(raw)  # type: ignore[return-value]
    except ValidationError as exc:
        error = from_validation_error(exc, raw)
        param = f"{where}.{error.param}" if error.param else where
        message = error.message.replace(f"'{error.param}'", f"'{param}'")
        raise errors.APIError(error.status, error.code, message, param=param) from None


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's bounds: at most 16 pairs, keys of 64 and values of 512 characters."""
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise errors.invalid_request(f"at most {MAX_METADATA_KEYS} metadata keys", "metadata")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise errors.invalid_request(
                "metadata keys are at most 64 characters and values at most 512", "metadata"
            )
