"""Models of the success bodies that routes build as plain dicts (health, model list,
generation and conversation resources): the keys a client may rely on, typed. Other keys may
appear (`extra="allow"`); the fuzz test checks every live answer against these."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from serve_app.store.base import TERMINAL_STATUSES, UNFINISHED_STATUSES

GenerationStatus = Literal[tuple(sorted({*UNFINISHED_STATUSES, *TERMINAL_STATUSES}))]  # type: ignore[valid-type]


class Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Health(Open):
    status: Literal["ok"]
    model: str


class ModelCard(Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    fingerprint: str


class ModelList(Open):
    object: Literal["list"]
    # Empty when the key may use none of the served models.
    data: list[ModelCard]


class OutputBlock(Open):
    type: Literal["text", "json"]


class GenerationUsage(Open):
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int
    kind: Literal["estimate", "provisional", "final"]


class GenerationError(Open):
    code: str
    message: str


class Generation(Open):
    """A generation resource (`/v1/generations`), as stored and returned."""

    id: str
    object: Literal["generation"]
    status: GenerationStatus
    output: list[OutputBlock]
    finish_reason: str | None
    usage: GenerationUsage
    error: GenerationError | None
    created_at: float
    # None while unfinished: retention counts from the end.
    expires_at: float | None


class TextDelta(Open):
    type: Literal["text"]
    text: str


class OutputDelta(Open):
    """An `output.delta` event of a streamed generation."""

    generation_id: str
    index: int
    delta: TextDelta
    usage: GenerationUsage


class Conversation(Open):
    """OpenAI's conversation object; `revision`, `pending_generation` and `expires_at` are
    ours."""

    id: str
    object: Literal["conversation"]
    created_at: int
    metadata: dict[str, str]
    revision: int
    pending_generation: str | None
    expires_at: float


class ItemText(Open):
    type: Literal["input_text", "output_text"]
    text: str


class ConversationItem(Open):
    """A message item of a conversation, as OpenAI's Conversations API lists it."""

    id: str
    type: Literal["message"]
    role: Literal["user", "assistant"]
    status: Literal["completed"]
    content: list[ItemText]


class ConversationItemList(Open):
    object: Literal["list"]
    data: list[ConversationItem]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ConversationDeleted(Open):
    id: str
    object: Literal["conversation.deleted"]
    deleted: Literal[True]


class ServerInfo(Open):
    """`/v1/server_info`: identity, limits, policies and outcomes as data."""

    model: str
    artifact: dict[str, Any]
    limits: dict[str, Any]
    errors: list[dict[str, Any]]
    outcomes: list[dict[str, Any]]


class OpenAPIDocument(Open):
    openapi: str
    info: dict[str, Any]
    paths: dict[str, Any]


class ResponseUsage(Open):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(Open):
    """A response of `/v1/responses`, as created, streamed and stored."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    previous_response_id: str | None
    store: bool
    background: bool


class ResponseEvent(Open):
    """One typed event of a streamed response (`type` names it, as the SSE event does)."""

    type: str
    sequence_number: int


class ResponseDeleted(Open):
    id: str
    object: Literal["response.deleted"]
    deleted: Literal[True]


class InputItemList(Open):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
