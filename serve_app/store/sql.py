"""The Store contract in portable SQL, shared by the SQLite and PostgreSQL backends.

A backend supplies its connection handling (`_write` and `_read` yield an object whose
`execute(sql, params)` takes `?` placeholders and returns a cursor with `fetchone`,
`fetchall` and `rowcount`), and its locking: `_lock_claim` serialises concurrent claims of
one idempotency key across processes, and `ROW_LOCK` locks a conversation row read inside a
write. Both backends keep the same schema (JSON as TEXT, times as Unix seconds).
"""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from serve_app.store.base import (
    CONV_COLUMNS,
    GEN_COLUMNS,
    RESPONSE_COLUMNS,
    UNFINISHED_STATUSES,
    ConversationRecord,
    ConversationTurn,
    EditOutcome,
    EditResult,
    GenerationRecord,
    IdempotencyKey,
    InsertOutcome,
    InsertResult,
    ResponseRecord,
    Store,
    StreamEvent,
    TurnAppend,
    conversation_from_row,
    generation_from_row,
    response_from_row,
)
from serve_app.store.items import items_of_messages

# Rows per INSERT statement of events (4 parameters each: under SQLite's oldest limit of 999).
EVENTS_PER_INSERT = 200


class _SequenceTaken(Exception):
    """An appended event's sequence number was already stored."""


class SQL(Protocol):
    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> Any: ...


class SQLStore(Store):
    # Appended to a conversation read inside a write transaction ("" where the transaction
    # already holds the database's write lock).
    ROW_LOCK = ""

    @abstractmethod
    def _write(self) -> AbstractContextManager[SQL]:
        """One write transaction, committed when the block ends, rolled back on error."""

    @abstractmethod
    def _read(self) -> AbstractContextManager[SQL]:
        """A consistent read."""

    def _lock_claim(self, db: SQL, tenant: str, key: IdempotencyKey) -> None:
        """Serialise concurrent claims of one key (a no-op where writes are serialised)."""

    # ---------------------------------------------------------------- generations

    def insert_generation(
        self,
        record: GenerationRecord,
        idempotency: IdempotencyKey | None = None,
        turn: ConversationTurn | None = None,
    ) -> InsertResult:
        now = self.clock()
        with self._write() as db:
            if idempotency is not None:
                self._lock_claim(db, record.tenant, idempotency)
                found = self._find_key(db, record.tenant, idempotency, now)
                if found is not None:
                    return found
            conversation = None
            if turn is not None:
                conversation = self._get_conversation(
                    db, record.tenant, turn.conversation_id, lock=True
                )
                if conversation is None:
                    return InsertResult(InsertOutcome.CONVERSATION_NOT_FOUND)
                if (
                    conversation.revision != turn.expected_revision
                    or conversation.pending_generation is not None
                ):
                    return InsertResult(InsertOutcome.STALE_REVISION, conversation=conversation)
                db.execute(
                    "UPDATE conversations SET pending_generation = ? WHERE id = ?",
                    (record.id, conversation.id),
                )
            db.execute(
                f"INSERT INTO generations ({GEN_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.id,
                    record.tenant,
                    record.status,
                    record.owner,
                    json.dumps(record.data),
                    record.created_at,
                    record.updated_at,
                    record.expires_at,
                ),
            )
            if idempotency is not None:
                # An expired key row may still be there (not purged yet): it is replaced.
                db.execute(
                    "INSERT INTO idempotency_keys (tenant, operation, key, body_hash,"
                    " generation_id, expires_at) VALUES (?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT (tenant, operation, key) DO UPDATE SET"
                    " body_hash = excluded.body_hash, generation_id = excluded.generation_id,"
                    " expires_at = excluded.expires_at",
                    (
                        record.tenant,
                        idempotency.operation,
                        idempotency.key,
                        idempotency.body_hash,
                        record.id,
                        idempotency.expires_at,
                    ),
                )
        return InsertResult(InsertOutcome.CREATED, record, conversation)

    def _find_key(
        self, db: SQL, tenant: str, key: IdempotencyKey, now: float
    ) -> InsertResult | None:
        row = db.execute(
            "SELECT body_hash, generation_id FROM idempotency_keys WHERE tenant = ? AND"
            " operation = ? AND key = ? AND expires_at > ?",
            (tenant, key.operation, key.key, now),
        ).fetchone()
        if row is None:
            return None
        existing = self._get_generation(db, tenant, row[1], now)
        if existing is None:
            # The generation it named has expired: the key is free again.
            return None
        outcome = InsertOutcome.REPLAY if row[0] == key.body_hash else InsertOutcome.KEY_REUSED
        return InsertResult(outcome, existing)

    def _get_generation(
        self, db: SQL, tenant: str, generation_id: str, now: float
    ) -> GenerationRecord | None:
        row = db.execute(
            f"SELECT {GEN_COLUMNS} FROM generations WHERE id = ? AND tenant = ?"
            " AND (expires_at IS NULL OR expires_at > ?)",
            (generation_id, tenant, now),
        ).fetchone()
        return None if row is None else generation_from_row(row)

    def get_generation(self, tenant: str, generation_id: str) -> GenerationRecord | None:
        with self._read() as db:
            return self._get_generation(db, tenant, generation_id, self.clock())

    def update_generation(self, record: GenerationRecord, expected_status: Collection[str]) -> bool:
        with self._write() as db:
            return self._update(db, record, expected_status)

    def _update(self, db: SQL, record: GenerationRecord, expected_status: Collection[str]) -> bool:
        statuses = sorted(expected_status)
        marks = ", ".join("?" for _ in statuses)
        cursor = db.execute(
            "UPDATE generations SET status = ?, data = ?, updated_at = ?, expires_at = ?"
            f" WHERE id = ? AND tenant = ? AND status IN ({marks})",
            (
                record.status,
                json.dumps(record.data),
                record.updated_at,
                record.expires_at,
                record.id,
                record.tenant,
                *statuses,
            ),
        )
        return cursor.rowcount == 1

    def finish_generation(
        self,
        record: GenerationRecord,
        expected_status: Collection[str],
        append: TurnAppend | None = None,
    ) -> bool:
        with self._write() as db:
            if not self._update(db, record, expected_status):
                return False
            row = db.execute(
                "SELECT id, items, revision FROM conversations"
                " WHERE tenant = ? AND pending_generation = ?" + self.ROW_LOCK,
                (record.tenant, record.id),
            ).fetchone()
            if row is None:
                return True
            if append is not None:
                items = json.loads(row[1]) + items_of_messages(append.messages)
                db.execute(
                    "UPDATE conversations SET items = ?, revision = ?,"
                    " pending_generation = NULL, updated_at = ?, expires_at = ? WHERE id = ?",
                    (
                        json.dumps(items),
                        row[2] + 1,
                        record.updated_at,
                        append.expires_at,
                        row[0],
                    ),
                )
            else:
                db.execute(
                    "UPDATE conversations SET pending_generation = NULL WHERE id = ?", (row[0],)
                )
            return True

    def heartbeat(self, owner: str) -> None:
        with self._write() as db:
            db.execute(
                "INSERT INTO owners (owner, heartbeat_at) VALUES (?, ?)"
                " ON CONFLICT (owner) DO UPDATE SET heartbeat_at = excluded.heartbeat_at",
                (owner, self.clock()),
            )

    def list_orphaned_generations(self, stale_after_s: float) -> list[GenerationRecord]:
        cutoff = self.clock() - stale_after_s
        with self._read() as db:
            rows = db.execute(
                f"SELECT {GEN_COLUMNS} FROM generations g WHERE status IN (?, ?)"
                " AND NOT EXISTS (SELECT 1 FROM owners o WHERE o.owner = g.owner"
                " AND o.heartbeat_at > ?)",
                (*UNFINISHED_STATUSES, cutoff),
            ).fetchall()
        return [generation_from_row(row) for row in rows]

    # -------------------------------------------------------------- conversations

    def create_conversation(self, record: ConversationRecord) -> None:
        with self._write() as db:
            db.execute(
                f"INSERT INTO conversations ({CONV_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.id,
                    record.tenant,
                    record.revision,
                    json.dumps(record.items),
                    record.pending_generation,
                    record.created_at,
                    record.updated_at,
                    record.expires_at,
                    json.dumps(record.metadata),
                ),
            )

    def _get_conversation(
        self, db: SQL, tenant: str, conversation_id: str, lock: bool = False
    ) -> ConversationRecord | None:
        row = db.execute(
            f"SELECT {CONV_COLUMNS} FROM conversations WHERE id = ? AND tenant = ?"
            " AND expires_at > ?" + (self.ROW_LOCK if lock else ""),
            (conversation_id, tenant, self.clock()),
        ).fetchone()
        return None if row is None else conversation_from_row(row)

    def get_conversation(self, tenant: str, conversation_id: str) -> ConversationRecord | None:
        with self._read() as db:
            return self._get_conversation(db, tenant, conversation_id)

    def delete_conversation(self, tenant: str, conversation_id: str) -> bool:
        with self._write() as db:
            cursor = db.execute(
                "DELETE FROM conversations WHERE id = ? AND tenant = ? AND expires_at > ?",
                (conversation_id, tenant, self.clock()),
            )
            return cursor.rowcount == 1

    def update_conversation_metadata(
        self, tenant: str, conversation_id: str, metadata: dict[str, str], expires_at: float
    ) -> ConversationRecord | None:
        with self._write() as db:
            cursor = db.execute(
                "UPDATE conversations SET metadata = ?, updated_at = ?, expires_at = ?"
                " WHERE id = ? AND tenant = ? AND expires_at > ?",
                (json.dumps(metadata), self.clock(), expires_at, conversation_id, tenant,
                 self.clock()),
            )  # fmt: skip
            if cursor.rowcount != 1:
                return None
            return self._get_conversation(db, tenant, conversation_id)

    def append_conversation_items(
        self,
        tenant: str,
        conversation_id: str,
        items: list[dict[str, Any]],
        expected_revision: int | None,
        expires_at: float,
    ) -> EditResult:
        return self._edit_items(
            tenant, conversation_id, expected_revision, expires_at, lambda old: old + items
        )

    def delete_conversation_item(
        self,
        tenant: str,
        conversation_id: str,
        item_id: str,
        expected_revision: int | None,
        expires_at: float,
    ) -> EditResult:
        def without(old: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
            kept = [item for item in old if item.get("id") != item_id]
            return None if len(kept) == len(old) else kept

        return self._edit_items(tenant, conversation_id, expected_revision, expires_at, without)

    def _edit_items(
        self,
        tenant: str,
        conversation_id: str,
        expected_revision: int | None,
        expires_at: float,
        edit: Callable[[list[dict[str, Any]]], list[dict[str, Any]] | None],
    ) -> EditResult:
        """The revision rule, then `edit` (None: the item it names is not there)."""
        with self._write() as db:
            conv = self._get_conversation(db, tenant, conversation_id, lock=True)
            if conv is None:
                return EditResult(EditOutcome.CONVERSATION_NOT_FOUND)
            stale = expected_revision is not None and expected_revision != conv.revision
            if stale or conv.pending_generation is not None:
                return EditResult(EditOutcome.STALE_REVISION, conv)
            items = edit(conv.items)
            if items is None:
                return EditResult(EditOutcome.ITEM_NOT_FOUND, conv)
            now = self.clock()
            db.execute(
                "UPDATE conversations SET items = ?, revision = ?, updated_at = ?,"
                " expires_at = ? WHERE id = ?",
                (json.dumps(items), conv.revision + 1, now, expires_at, conv.id),
            )
            edited = ConversationRecord(
                conv.id, tenant, conv.revision + 1, items, conv.created_at, now, expires_at,
                None, conv.metadata,
            )  # fmt: skip
            return EditResult(EditOutcome.APPLIED, edited)

    def _migrate_conversations(self, db: SQL, columns: set[str]) -> None:
        """A conversations table of the first schema (`messages` as chat messages, no
        metadata) becomes the current one: its messages become items with ids."""
        if "items" in columns or "messages" not in columns:
            return
        db.execute("ALTER TABLE conversations RENAME COLUMN messages TO items")
        db.execute("ALTER TABLE conversations ADD COLUMN metadata TEXT NOT NULL DEFAULT '{}'")
        for cid, messages in db.execute("SELECT id, items FROM conversations").fetchall():
            items = items_of_messages(json.loads(messages))
            db.execute("UPDATE conversations SET items = ? WHERE id = ?", (json.dumps(items), cid))

    # ------------------------------------------------------------------ responses

    def insert_response(self, record: ResponseRecord, events: Sequence[StreamEvent] = ()) -> None:
        with self._write() as db:
            db.execute(
                f"INSERT INTO responses ({RESPONSE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?)",
                (
                    record.id,
                    record.tenant,
                    record.status,
                    json.dumps(record.data),
                    record.created_at,
                    record.expires_at,
                ),
            )
            if not self._append_events(db, record, events):
                raise ValueError(f"response {record.id}: an event's sequence number repeats")

    def get_response(self, tenant: str, response_id: str) -> ResponseRecord | None:
        with self._read() as db:
            row = db.execute(
                f"SELECT {RESPONSE_COLUMNS} FROM responses WHERE id = ? AND tenant = ?"
                " AND expires_at > ?",
                (response_id, tenant, self.clock()),
            ).fetchone()
        return None if row is None else response_from_row(row)

    def get_response_events(self, tenant: str, response_id: str, after: int) -> list[StreamEvent]:
        with self._read() as db:
            row = db.execute(
                "SELECT data FROM responses WHERE id = ? AND tenant = ? AND expires_at > ?",
                (response_id, tenant, self.clock()),
            ).fetchone()
            if row is None:
                return []
            rows = db.execute(
                "SELECT data FROM response_events WHERE tenant = ? AND response_id = ?"
                " AND seq > ? ORDER BY seq",
                (tenant, response_id, after),
            ).fetchall()
        # A record of the previous schema holds its events in `data` (the table may hold
        # only the terminal event a later reader appended after them).
        kept = json.loads(row[0]).get("events", [])
        return kept[after + 1 :] + [json.loads(data) for (data,) in rows]

    def delete_response(self, tenant: str, response_id: str) -> bool:
        with self._write() as db:
            cursor = db.execute(
                "DELETE FROM responses WHERE id = ? AND tenant = ? AND expires_at > ?",
                (response_id, tenant, self.clock()),
            )
            if cursor.rowcount != 1:
                return False
            db.execute(
                "DELETE FROM response_events WHERE tenant = ? AND response_id = ?",
                (tenant, response_id),
            )
            return True

    def update_response(
        self,
        record: ResponseRecord,
        expected_status: Collection[str],
        events: Sequence[StreamEvent] = (),
    ) -> bool:
        statuses = sorted(expected_status)
        marks = ", ".join("?" for _ in statuses)
        try:
            with self._write() as db:
                cursor = db.execute(
                    "UPDATE responses SET status = ?, data = ?, expires_at = ?"
                    f" WHERE id = ? AND tenant = ? AND expires_at > ? AND status IN ({marks})",
                    (
                        record.status,
                        json.dumps(record.data),
                        record.expires_at,
                        record.id,
                        record.tenant,
                        self.clock(),
                        *statuses,
                    ),
                )
                if cursor.rowcount != 1:
                    return False
                if not self._append_events(db, record, events):
                    raise _SequenceTaken  # rolls the update back
                return True
        except _SequenceTaken:
            return False

    def _append_events(
        self, db: SQL, record: ResponseRecord, events: Sequence[StreamEvent]
    ) -> bool:
        """Insert the events' rows; False when a sequence number was already stored (the
        caller rolls back: another writer numbered the same events)."""
        for start in range(0, len(events), EVENTS_PER_INSERT):
            batch = events[start : start + EVENTS_PER_INSERT]
            params: list[Any] = []
            for event in batch:
                params += [record.tenant, record.id, event["sequence_number"], json.dumps(event)]
            cursor = db.execute(
                "INSERT INTO response_events (tenant, response_id, seq, data) VALUES "
                + ", ".join("(?, ?, ?, ?)" for _ in batch)
                + " ON CONFLICT (tenant, response_id, seq) DO NOTHING",
                tuple(params),
            )
            if cursor.rowcount != len(batch):
                return False
        return True

    # ---------------------------------------------------------------------- upkeep

    def purge_expired(self) -> int:
        now = self.clock()
        with self._write() as db:
            # An expired response's events go with it (not counted: they are part of it).
            db.execute(
                "DELETE FROM response_events WHERE (tenant, response_id) IN"
                " (SELECT tenant, id FROM responses WHERE expires_at <= ?)",
                (now,),
            )
            removed = 0
            for table in ("generations", "idempotency_keys", "conversations", "responses"):
                cursor = db.execute(
                    f"DELETE FROM {table} WHERE expires_at IS NOT NULL AND expires_at <= ?",
                    (now,),
                )
                removed += cursor.rowcount
            return removed
