"""Durable state of the resource APIs: generation resources, idempotency keys, conversations,
and stored responses (`/v1/responses`).

`Store` is the seam; `store_sqlite.SQLiteStore` (WAL, one file in a local data folder) is the
default and `store_postgres.PostgresStore` mirrors the same schema for clusters. Methods are
synchronous (callers use `asyncio.to_thread`), every method is one transaction, and a method
returns only after its transaction is committed: a write the caller answers about is never
lost.

Schema (plain SQL types, JSON as TEXT, times as REAL Unix seconds):

    generations(id TEXT PK, tenant TEXT, status TEXT, owner TEXT, data TEXT,
                created_at REAL, updated_at REAL, expires_at REAL NULL)
    idempotency_keys(tenant TEXT, operation TEXT, key TEXT, body_hash TEXT,
                     generation_id TEXT, expires_at REAL, PK(tenant, operation, key))
    conversations(id TEXT PK, tenant TEXT, revision INTEGER, items TEXT, metadata TEXT,
                  pending_generation TEXT NULL, created_at REAL, updated_at REAL,
                  expires_at REAL)
    owners(owner TEXT PK, heartbeat_at REAL)
    responses(id TEXT PK, tenant TEXT, status TEXT, data TEXT, created_at REAL,
              expires_at REAL)
    response_events(tenant TEXT, response_id TEXT, seq INTEGER, data TEXT,
                    PK(tenant, response_id, seq))

A stored response's stream events are rows of `response_events` (appended, never rewritten),
so keeping them costs bytes in proportion to their number; records written before that table
existed hold them in `data["events"]`, and are still read from there.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

Clock = Callable[[], float]
# A numbered stream event of a stored response (its `sequence_number` is its row's `seq`).
StreamEvent = dict[str, Any]

# Statuses after which a generation never changes again.
TERMINAL_STATUSES = frozenset({"completed", "incomplete", "refused", "failed", "cancelled"})
UNFINISHED_STATUSES = ("queued", "running")


@dataclass(frozen=True)
class GenerationRecord:
    """One generation resource. `data` is the rest of its JSON (never `id`/`status`)."""

    id: str
    tenant: str
    status: str
    owner: str
    data: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    updated_at: float = 0.0
    # None while unfinished: retention counts from the end.
    expires_at: float | None = None

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


@dataclass(frozen=True)
class ConversationRecord:
    """A conversation: its message items in order (`store.items`), each with its id; any
    change to them bumps `revision` by one."""

    id: str
    tenant: str
    revision: int
    items: list[dict[str, Any]]
    created_at: float
    updated_at: float
    expires_at: float
    # The generation that holds the next turn, if any (at most one at a time).
    pending_generation: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class IdempotencyKey:
    operation: str
    key: str
    body_hash: str  # of the normalized request
    expires_at: float


@dataclass(frozen=True)
class ConversationTurn:
    """A generation's claim on the next turn of a conversation."""

    conversation_id: str
    expected_revision: int


@dataclass(frozen=True)
class TurnAppend:
    """What a finished generation adds to the conversation turn it held: chat messages
    (`{"role", "content"}`), stored as new message items."""

    messages: list[dict[str, Any]]
    # The conversation's new expiry (retention counts from its last change).
    expires_at: float


@dataclass(frozen=True)
class ResponseRecord:
    """One stored response of `/v1/responses`: `data` holds the response object, its input
    items and the context a later response that names it continues from."""

    id: str
    tenant: str
    status: str
    data: dict[str, Any]
    created_at: float
    expires_at: float


class EditOutcome(Enum):
    APPLIED = "applied"
    CONVERSATION_NOT_FOUND = "conversation_not_found"
    ITEM_NOT_FOUND = "item_not_found"
    STALE_REVISION = "stale_revision"  # revision moved on, or a turn is pending


@dataclass(frozen=True)
class EditResult:
    outcome: EditOutcome
    # APPLIED: the conversation after the edit; STALE_REVISION / ITEM_NOT_FOUND: as it is.
    conversation: ConversationRecord | None = None


class InsertOutcome(Enum):
    CREATED = "created"
    REPLAY = "replay"  # the idempotency key names an existing generation, same body
    KEY_REUSED = "key_reused"  # same key, different body
    CONVERSATION_NOT_FOUND = "conversation_not_found"
    STALE_REVISION = "stale_revision"  # revision moved on, or another turn is pending


@dataclass(frozen=True)
class InsertResult:
    outcome: InsertOutcome
    # CREATED: the new record; REPLAY / KEY_REUSED: the generation the key names.
    generation: GenerationRecord | None = None
    conversation: ConversationRecord | None = None


class Store(ABC):
    """Durable state behind the generations API.

    Invariants every backend keeps:
    - Tenant scoping: every read and write names a tenant and never sees another tenant's
      rows (a record of tenant A is "not found" for tenant B). The only cross-tenant reads
      are `list_orphaned_generations` and `purge_expired`, used by the server itself.
    - Atomic admission: `insert_generation` checks the idempotency key, reserves the
      conversation turn and inserts the record in one transaction; concurrent callers with
      the same key get exactly one CREATED.
    - Compare-and-set: `update_generation` and `finish_generation` write only when the
      stored status is one of `expected_status`; a terminal record never changes again.
    - Expiry: a row whose `expires_at` has passed reads as absent, whether or not
      `purge_expired` has run yet.
    - Durability: a method returns only after its transaction committed.
    """

    def __init__(self, clock: Clock = time.time) -> None:
        self.clock = clock

    @abstractmethod
    def insert_generation(
        self,
        record: GenerationRecord,
        idempotency: IdempotencyKey | None = None,
        turn: ConversationTurn | None = None,
    ) -> InsertResult:
        """Record a new generation; REPLAY/KEY_REUSED/... leave the store unchanged."""

    @abstractmethod
    def get_generation(self, tenant: str, generation_id: str) -> GenerationRecord | None: ...

    @abstractmethod
    def update_generation(self, record: GenerationRecord, expected_status: Collection[str]) -> bool:
        """Replace status/data/expires_at if the stored status is expected; False otherwise."""

    @abstractmethod
    def finish_generation(
        self,
        record: GenerationRecord,
        expected_status: Collection[str],
        append: TurnAppend | None = None,
    ) -> bool:
        """`update_generation` plus, in the same transaction, the conversation turn it held:
        with `append` its messages are appended, the revision bumped by one and the expiry
        moved; without, the turn is only released. False (nothing written) on a status
        mismatch."""

    @abstractmethod
    def heartbeat(self, owner: str) -> None:
        """Mark `owner` (one server process) alive now."""

    @abstractmethod
    def list_orphaned_generations(self, stale_after_s: float) -> list[GenerationRecord]:
        """Unfinished generations whose owner has not beaten for `stale_after_s` (any tenant)."""

    @abstractmethod
    def create_conversation(self, record: ConversationRecord) -> None: ...

    @abstractmethod
    def get_conversation(self, tenant: str, conversation_id: str) -> ConversationRecord | None: ...

    @abstractmethod
    def delete_conversation(self, tenant: str, conversation_id: str) -> bool: ...

    @abstractmethod
    def update_conversation_metadata(
        self, tenant: str, conversation_id: str, metadata: dict[str, str], expires_at: float
    ) -> ConversationRecord | None:
        """Replace the metadata (the revision stays: the history did not change)."""

    @abstractmethod
    def append_conversation_items(
        self,
        tenant: str,
        conversation_id: str,
        items: list[dict[str, Any]],
        expected_revision: int | None,
        expires_at: float,
    ) -> EditResult:
        """Append items and bump the revision by one, under the revision rule: STALE_REVISION
        (nothing written) while a generation holds the next turn, or when `expected_revision`
        is given and the revision moved on."""

    @abstractmethod
    def delete_conversation_item(
        self,
        tenant: str,
        conversation_id: str,
        item_id: str,
        expected_revision: int | None,
        expires_at: float,
    ) -> EditResult:
        """Remove one item and bump the revision, under the same rule as appending."""

    @abstractmethod
    def insert_response(self, record: ResponseRecord, events: Sequence[StreamEvent] = ()) -> None:
        """Record a response (its id is new) with its first stream events."""

    @abstractmethod
    def get_response(self, tenant: str, response_id: str) -> ResponseRecord | None: ...

    @abstractmethod
    def get_response_events(self, tenant: str, response_id: str, after: int) -> list[StreamEvent]:
        """The response's stream events numbered after `after`, in order ([] when the
        response is absent or expired)."""

    @abstractmethod
    def delete_response(self, tenant: str, response_id: str) -> bool:
        """Delete it and its events; False when there was none (for this tenant, unexpired)."""

    @abstractmethod
    def update_response(
        self,
        record: ResponseRecord,
        expected_status: Collection[str],
        events: Sequence[StreamEvent] = (),
    ) -> bool:
        """Replace status/data/expires_at of an unexpired response of the record's tenant if
        its stored status is expected, and append `events` in the same transaction; False
        (nothing written) otherwise, or when one of their sequence numbers is already stored
        (compare-and-set, as generations)."""

    @abstractmethod
    def purge_expired(self) -> int:
        """Delete every expired row (any tenant), an expired response's events with it;
        returns how many rows went (a response's events not counted)."""

    @abstractmethod
    def close(self) -> None: ...


# ------------------------------------------------------- row helpers (both backends)

GEN_COLUMNS = "id, tenant, status, owner, data, created_at, updated_at, expires_at"
RESPONSE_COLUMNS = "id, tenant, status, data, created_at, expires_at"
CONV_COLUMNS = (
    "id, tenant, revision, items, pending_generation, created_at, updated_at, expires_at, metadata"
)


def generation_from_row(row: tuple[Any, ...]) -> GenerationRecord:
    gid, tenant, status, owner, data, created_at, updated_at, expires_at = row
    return GenerationRecord(
        gid, tenant, status, owner, json.loads(data), created_at, updated_at, expires_at
    )


def conversation_from_row(row: tuple[Any, ...]) -> ConversationRecord:
    cid, tenant, revision, items, pending, created_at, updated_at, expires_at, metadata = row
    return ConversationRecord(
        cid,
        tenant,
        revision,
        json.loads(items),
        created_at,
        updated_at,
        expires_at,
        pending,
        json.loads(metadata),
    )


def response_from_row(row: tuple[Any, ...]) -> ResponseRecord:
    rid, tenant, status, data, created_at, expires_at = row
    return ResponseRecord(rid, tenant, status, json.loads(data), created_at, expires_at)


__all__ = [
    "ConversationRecord",
    "ConversationTurn",
    "EditOutcome",
    "EditResult",
    "GenerationRecord",
    "IdempotencyKey",
    "InsertOutcome",
    "InsertResult",
    "ResponseRecord",
    "Store",
    "StreamEvent",
    "TERMINAL_STATUSES",
    "TurnAppend",
]
