"""The SQLite backend of the Store: one file in WAL mode (the default, in a local data
folder). Every write transaction takes the write lock up front (BEGIN IMMEDIATE), so the
threads of one process and several processes on one host stay consistent; FULL sync makes a
commit survive power loss, not only a process crash."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

from serve_app.store import (
    CONV_COLUMNS,
    GEN_COLUMNS,
    UNFINISHED_STATUSES,
    Clock,
    ConversationRecord,
    ConversationTurn,
    GenerationRecord,
    IdempotencyKey,
    InsertOutcome,
    InsertResult,
    Store,
    TurnAppend,
    conversation_from_row,
    generation_from_row,
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS generations (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, status TEXT NOT NULL, owner TEXT NOT NULL,
    data TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL, expires_at REAL
);
CREATE INDEX IF NOT EXISTS generations_status ON generations (status);
CREATE TABLE IF NOT EXISTS idempotency_keys (
    tenant TEXT NOT NULL, operation TEXT NOT NULL, key TEXT NOT NULL,
    body_hash TEXT NOT NULL, generation_id TEXT NOT NULL, expires_at REAL NOT NULL,
    PRIMARY KEY (tenant, operation, key)
);
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, revision INTEGER NOT NULL,
    messages TEXT NOT NULL, pending_generation TEXT, created_at REAL NOT NULL,
    updated_at REAL NOT NULL, expires_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS owners (owner TEXT PRIMARY KEY, heartbeat_at REAL NOT NULL);
"""


class SQLiteStore(Store):
    """One SQLite file in WAL mode; safe for the threads of one process and for several
    processes on one host (each write transaction takes the write lock up front)."""

    def __init__(self, path: str | Path, clock: Clock = time.time) -> None:
        super().__init__(clock)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves.
        self._db = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=30.0
        )
        self._lock = threading.Lock()
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit survives power loss, not only a process crash.
        self._db.execute("PRAGMA synchronous=FULL")
        with self._write() as db:
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self._db

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
                found = self._find_key(db, record.tenant, idempotency, now)
                if found is not None:
                    return found
            conversation = None
            if turn is not None:
                conversation = self._get_conversation(db, record.tenant, turn.conversation_id)
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
                db.execute(
                    "INSERT OR REPLACE INTO idempotency_keys (tenant, operation, key, body_hash,"
                    " generation_id, expires_at) VALUES (?, ?, ?, ?, ?, ?)",
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
        self, db: sqlite3.Connection, tenant: str, key: IdempotencyKey, now: float
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
        self, db: sqlite3.Connection, tenant: str, generation_id: str, now: float
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

    def _update(
        self, db: sqlite3.Connection, record: GenerationRecord, expected_status: Collection[str]
    ) -> bool:
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
                "SELECT id, messages, revision FROM conversations"
                " WHERE tenant = ? AND pending_generation = ?",
                (record.tenant, record.id),
            ).fetchone()
            if row is None:
                return True
            if append is not None:
                messages = json.loads(row[1]) + append.messages
                db.execute(
                    "UPDATE conversations SET messages = ?, revision = ?,"
                    " pending_generation = NULL, updated_at = ?, expires_at = ? WHERE id = ?",
                    (
                        json.dumps(messages),
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
                "INSERT OR REPLACE INTO owners (owner, heartbeat_at) VALUES (?, ?)",
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
                f"INSERT INTO conversations ({CONV_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    record.id,
                    record.tenant,
                    record.revision,
                    json.dumps(record.messages),
                    record.pending_generation,
                    record.created_at,
                    record.updated_at,
                    record.expires_at,
                ),
            )

    def _get_conversation(
        self, db: sqlite3.Connection, tenant: str, conversation_id: str
    ) -> ConversationRecord | None:
        row = db.execute(
            f"SELECT {CONV_COLUMNS} FROM conversations WHERE id = ? AND tenant = ?"
            " AND expires_at > ?",
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

    # ---------------------------------------------------------------------- upkeep

    def purge_expired(self) -> int:
        now = self.clock()
        with self._write() as db:
            removed = 0
            for table in ("generations", "idempotency_keys", "conversations"):
                cursor = db.execute(
                    f"DELETE FROM {table} WHERE expires_at IS NOT NULL AND expires_at <= ?",
                    (now,),
                )
                removed += cursor.rowcount
            return removed

    def close(self) -> None:
        with self._lock:
            self._db.close()
