"""Request bodies of `/v1/generations` and `/v1/conversations` (strict: unknown fields are a
400 naming the field), and the normalized form an Idempotency-Key is recorded with (`body_hash`)."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from serve_app import errors
from serve_app.protocol.parsing import from_validation_error, load_json_object

MAX_MESSAGES = 256


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


class ConversationCreate(Strict):
    messages: list[InputMessage] = Field(default_factory=list, max_length=MAX_MESSAGES)
    metadata: dict[str, str] | None = None


def parse_body(model: type[Strict], body: bytes) -> Any:
    data: dict[str, Any] = load_json_object(body) if body.strip() else {}
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, data) from None
