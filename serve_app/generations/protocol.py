"""Request bodies of `/v1/generations` and `/v1/conversations` (strict: unknown fields are a
400 naming the field), and the normalized form an Idempotency-Key is recorded with (`body_hash`).
Conversation bodies take OpenAI's Conversations API shapes (message items, metadata)."""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from serve_app import errors
from serve_app.protocol.parsing import from_validation_error, load_json_object
from serve_app.store.items import message_item

MAX_MESSAGES = 256
# OpenAI's bounds: at most 16 pairs, keys of 64 and values of 512 characters.
MAX_METADATA_KEYS = 16
Metadata = Annotated[
    dict[
        Annotated[str, StringConstraints(max_length=64)],
        Annotated[str, StringConstraints(max_length=512)],
    ],
    Field(max_length=MAX_METADATA_KEYS),
]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputMessage(Strict):
    # No "system": the profile owns the instructions.
    role: Literal["user", "assistant"]
    content: str


class ConversationRef(Strict):
    id: str = Field(min_length=1, max_length=128)
    expected_revision: int = Field(ge=0)


class GenerationCreate(Strict):
    profile: str = Field(min_length=1, max_length=64)
    input: str | list[InputMessage] = Field(min_length=1)
    conversation: ConversationRef | None = None
    # None: the profile's first model (the served model when it names none).
    model: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    output_format: str | None = None
    execution: Literal["sync", "stream", "background"] = "sync"
    # Accepted and ignored: changes nothing here.
    metadata: dict[str, str] | None = None

    def input_messages(self) -> list[dict[str, str]]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        if len(self.input) > MAX_MESSAGES:
            raise errors.invalid_request(f"at most {MAX_MESSAGES} input messages", "input")
        return [m.model_dump() for m in self.input]

    def body_hash(self) -> str:
        """sha256 of the normalized request: equal requests hash equal whatever their key
        order, whitespace or spelled-out defaults; `execution` is part of it."""
        normalized = self.model_dump(mode="json", exclude={"metadata"})
        normalized["input"] = self.input_messages()
        text = json.dumps(normalized, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


class TextPart(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    # An assistant item read back from a conversation carries these.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(Strict):
    """A message item of the Responses API's input (`{"role", "content"}` is one too)."""

    type: Literal["message"] = "message"
    # No "system" or "developer": a generation's profile owns the instructions.
    role: Literal["user", "assistant"]
    content: str | list[TextPart]
    # An item read back may be sent again: the stored copy gets an id of its own.
    id: str | None = None
    status: str | None = None

    def stored(self) -> dict[str, Any]:
        if isinstance(self.content, str):
            return message_item(self.role, self.content)
        return message_item(self.role, "".join(part.text for part in self.content))


Items = Annotated[list[MessageItem], Field(max_length=MAX_MESSAGES)]


class ConversationCreate(Strict):
    items: Items | None = None
    metadata: Metadata | None = None
    # Accepted and ignored: changes nothing here.
    safety_identifier: str | None = None


class ConversationUpdate(Strict):
    metadata: Metadata | None


class ConversationItemsCreate(Strict):
    items: Annotated[list[MessageItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    # Our extension: append only at this revision (409 stale_revision otherwise).
    expected_revision: int | None = Field(None, ge=0)


ITEM_TYPES = "message items only (function calls and tool outputs are not stored yet)"
TEXT_PARTS = ("input_text", "output_text")


def check_item_types(data: dict[str, Any]) -> None:
    """Known OpenAI item and part types this server does not store: refused by name."""
    items = data.get("items")
    for i, item in enumerate(items if isinstance(items, list) else ()):
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if isinstance(kind, str) and kind != "message":
            raise errors.unsupported_parameter(
                f"items.{i}.type", f"'{errors.echo(kind)}': {ITEM_TYPES}"
            )
        parts = item.get("content")
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            ptype = part.get("type") if isinstance(part, dict) else None
            if isinstance(ptype, str) and ptype not in TEXT_PARTS:
                raise errors.unsupported_parameter(
                    f"items.{i}.content.{j}.type",
                    f"content parts of type '{errors.echo(ptype)}' (text only)",
                )


def parse_body(model: type[Strict], body: bytes) -> Any:
    data: dict[str, Any] = load_json_object(body) if body.strip() else {}
    if "items" in model.model_fields:
        check_item_types(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, data) from None
