"""A `POST /v1/responses` body restated as the chat request the engine path already admits:
input items become chat messages, and tools, tool_choice and text.format the same grammars as
on chat; a chat admission error is renamed to the Responses request's own fields."""

from __future__ import annotations

import re
from typing import Any

from serve_app import errors
from serve_app.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    NamedFunction,
    ReasoningItem,
    ResponseCreate,
    TextFormat,
)


def chat_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages, in order: consecutive function calls are one assistant
    turn (parallel calls), a reasoning item rides on the assistant turn after it."""
    messages: list[dict[str, Any]] = []
    reasoning = ""
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning += item.text
            continue
        if isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
            continue
        if isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text})
        if reasoning and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = reasoning
            reasoning = ""
    return messages


def chat_body(
    req: ResponseCreate, messages: list[dict[str, Any]], max_tokens: int | None
) -> dict[str, Any]:
    """The chat request this response runs as (its fields, in chat's shapes)."""
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    for name, value in (
        ("max_completion_tokens", max_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("parallel_tool_calls", req.parallel_tool_calls),
    ):
        if value is not None:
            body[name] = value
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
    if isinstance(req.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = response_format(fmt)
    return body


def response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type == "json_object":
        if fmt.schema_ is not None or fmt.name is not None:
            raise errors.invalid_request(
                "'text.format' of type 'json_object' takes no name or schema.", "text.format"
            )
        return {"type": "json_object"}
    if fmt.name is None:
        raise errors.invalid_request(
            "Missing required parameter: 'text.format.name'.", "text.format.name"
        )
    if fmt.schema_ is None:
        raise errors.invalid_request(
            "Missing required parameter: 'text.format.schema'.", "text.format.schema"
        )
    schema = {"name": fmt.name, "schema": fmt.schema_}
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    if fmt.description is not None:
        schema["description"] = fmt.description
    return {"type": "json_schema", "json_schema": schema}


_TOOL_FIELD = re.compile(r"tools\.(\d+)\.function\.")
# Chat's names for the fields a Responses request names otherwise.
_RENAMES = (
    ("response_format.json_schema.", "text.format."),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("tool_choice.function.", "tool_choice."),
    ("messages", "input"),
)


def renamed(exc: errors.APIError) -> errors.APIError:
    """A chat admission error, naming the Responses request's own fields."""

    def rename(text: str) -> str:
        for old, new in _RENAMES:
            text = text.replace(old, new)
        # tools.N.function.X -> tools.N.X
        return _TOOL_FIELD.sub(r"tools.\1.", text)

    param = rename(exc.param) if exc.param else exc.param
    error = errors.APIError(exc.status, exc.code, rename(exc.message), param=param)
    error.headers = exc.headers
    return error
