"""PostgreSQL backend of the Store: the same schema and contract as SQLiteStore, for clusters
where any ingress replica (on any node) may serve any read.

Concurrency across processes: an idempotency claim takes a transaction-level advisory lock
on its (tenant, operation, key), so concurrent claims serialise and exactly one creates; a
conversation turn locks its conversation row (`FOR UPDATE`). Every method is one transaction
that has committed when the method returns (PostgreSQL's default synchronous commit).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

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

# Times are Unix seconds: DOUBLE PRECISION (REAL is 4 bytes in PostgreSQL: too coarse).
SCHEMA = [
    """CREATE TABLE IF NOT EXISTS generations (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, status TEXT NOT NULL, owner TEXT NOT NULL,
        data TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL, expires_at DOUBLE PRECISION)""",
    "CREATE INDEX IF NOT EXISTS generations_status ON generations (status)",
    """CREATE TABLE IF NOT EXISTS idempotency_keys (
        tenant TEXT NOT NULL, operation TEXT NOT NULL, key TEXT NOT NULL,
        body_hash TEXT NOT NULL, generation_id TEXT NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (tenant, operation, key))""",
    """CREATE TABLE IF NOT EXISTS conversations (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, revision BIGINT NOT NULL,
        messages TEXT NOT NULL, pending_generation TEXT,
        created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS owners (
        owner TEXT PRIMARY KEY, heartbeat_at DOUBLE PRECISION NOT NULL)""",
]
# Advisory lock ids: schema creation (concurrent CREATE ... IF NOT EXISTS can still collide).
SCHEMA_LOCK = 7_324_001
CONNECT_TIMEOUT_S = 10

Cursor = psycopg.Cursor[Any]


class PostgresStore(Store):
    """One connection per store, shared by the caller's threads under a lock (as SQLiteStore);
    a broken connection is replaced on the next call."""

    def __init__(self, url: str, clock: Clock = time.time) -> None:
        super().__init__(clock)
        self.url = url
        self._lock = threading.Lock()
        self._conn = self._connect()
        with self._tx() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
            for statement in SCHEMA:
                cur.execute(statement)

    def _connect(self) -> psycopg.Connection[Any]:
        # autocommit: each `transaction()` block below is one explicit BEGIN ... COMMIT.
        return psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)

    @contextmanager
    def _tx(self) -> Iterator[Cursor]:
        with self._lock:
            if self._conn.closed or self._conn.broken:
                self._conn = self._connect()
            with self._conn.transaction(), self._conn.cursor() as cur:
                yield cur

    # ---------------------------------------------------------------- generations

    def insert_generation(
        self,
        record: GenerationRecord,
        idempotency: IdempotencyKey | None = None,
        turn: ConversationTurn | None = None,
    ) -> InsertResult:
        now = self.clock()
        with self._tx() as cur:
            if idempotency is not None:
                claim = f"{record.tenant}\x1f{idempotency.operation}\x1f{idempotency.key}"
                cur.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (claim,))
                found = self._find_key(cur, record.tenant, idempotency, now)
                if found is not None:
                    return found
            conversation = None
            if turn is not None:
                conversation = self._get_conversation(
                    cur, record.tenant, turn.conversation_id, lock=True
                )
                if conversation is None:
                    return InsertResult(InsertOutcome.CONVERSATION_NOT_FOUND)
                if (
                    conversation.revision != turn.expected_revision
                    or conversation.pending_generation is not None
                ):
                    return InsertResult(InsertOutcome.STALE_REVISION, conversation=conversation)
                cur.execute(
                    "UPDATE conversations SET pending_generation = %s WHERE id = %s",
                    (record.id, conversation.id),
                )
            cur.execute(
                f"INSERT INTO generations ({GEN_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
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
                self._record_key(cur, record, idempotency)
        return InsertResult(InsertOutcome.CREATED, record, conversation)

    @staticmethod
    def _record_key(cur: Cursor, record: GenerationRecord, key: IdempotencyKey) -> None:
        # An expired key row may still be there (not purged yet): it is replaced.
        cur.execute(
            "INSERT INTO idempotency_keys (tenant, operation, key, body_hash, generation_id,"
            " expires_at) VALUES (%s, %s, %s, %s, %s, %s)"
            " ON CONFLICT (tenant, operation, key) DO UPDATE SET"
            " body_hash = EXCLUDED.body_hash, generation_id = EXCLUDED.generation_id,"
            " expires_at = EXCLUDED.expires_at",
            (record.tenant, key.operation, key.key, key.body_hash, record.id, key.expires_at),
        )

    def _find_key(
        self, cur: Cursor, tenant: str, key: IdempotencyKey, now: float
    ) -> InsertResult | None:
        cur.execute(
            "SELECT body_hash, generation_id FROM idempotency_keys WHERE tenant = %s AND"
            " operation = %s AND key = %s AND expires_at > %s",
            (tenant, key.operation, key.key, now),
        )
        row = cur.fetchone()
        if row is None:
            return None
        existing = self._get_generation(cur, tenant, row[1], now)
        if existing is None:
            # The generation it named has expired: the key is free again.
            return None
        outcome = InsertOutcome.REPLAY if row[0] == key.body_hash else InsertOutcome.KEY_REUSED
        return InsertResult(outcome, existing)

    @staticmethod
    def _get_generation(
        cur: Cursor, tenant: str, generation_id: str, now: float
    ) -> GenerationRecord | None:
        cur.execute(
            f"SELECT {GEN_COLUMNS} FROM generations WHERE id = %s AND tenant = %s"
            " AND (expires_at IS NULL OR expires_at > %s)",
            (generation_id, tenant, now),
        )
        row = cur.fetchone()
        return None if row is None else generation_from_row(row)

    def get_generation(self, tenant: str, generation_id: str) -> GenerationRecord | None:
        with self._tx() as cur:
            return self._get_generation(cur, tenant, generation_id, self.clock())

    def update_generation(self, record: GenerationRecord, expected_status: Collection[str]) -> bool:
        with self._tx() as cur:
            return self._update(cur, record, expected_status)

    @staticmethod
    def _update(cur: Cursor, record: GenerationRecord, expected_status: Collection[str]) -> bool:
        cur.execute(
            "UPDATE generations SET status = %s, data = %s, updated_at = %s, expires_at = %s"
            " WHERE id = %s AND tenant = %s AND status = ANY(%s)",
            (
                record.status,
                json.dumps(record.data),
                record.updated_at,
                record.expires_at,
                record.id,
                record.tenant,
                sorted(expected_status),
            ),
        )
        return cur.rowcount == 1

    def finish_generation(
        self,
        record: GenerationRecord,
        expected_status: Collection[str],
        append: TurnAppend | None = None,
    ) -> bool:
        with self._tx() as cur:
            if not self._update(cur, record, expected_status):
                return False
            cur.execute(
                "SELECT id, messages, revision FROM conversations"
                " WHERE tenant = %s AND pending_generation = %s FOR UPDATE",
                (record.tenant, record.id),
            )
            row = cur.fetchone()
            if row is None:
                return True
            if append is None:
                cur.execute(
                    "UPDATE conversations SET pending_generation = NULL WHERE id = %s", (row[0],)
                )
                return True
            messages = json.loads(row[1]) + append.messages
            cur.execute(
                "UPDATE conversations SET messages = %s, revision = %s,"
                " pending_generation = NULL, updated_at = %s, expires_at = %s WHERE id = %s",
                (json.dumps(messages), row[2] + 1, record.updated_at, append.expires_at, row[0]),
            )
            return True

    def heartbeat(self, owner: str) -> None:
        with self._tx() as cur:
            cur.execute(
                "INSERT INTO owners (owner, heartbeat_at) VALUES (%s, %s)"
                " ON CONFLICT (owner) DO UPDATE SET heartbeat_at = EXCLUDED.heartbeat_at",
                (owner, self.clock()),
            )

    def list_orphaned_generations(self, stale_after_s: float) -> list[GenerationRecord]:
        cutoff = self.clock() - stale_after_s
        with self._tx() as cur:
            cur.execute(
                f"SELECT {GEN_COLUMNS} FROM generations g WHERE status = ANY(%s)"
                " AND NOT EXISTS (SELECT 1 FROM owners o WHERE o.owner = g.owner"
                " AND o.heartbeat_at > %s)",
                (list(UNFINISHED_STATUSES), cutoff),
            )
            rows = cur.fetchall()
        return [generation_from_row(row) for row in rows]

    # -------------------------------------------------------------- conversations

    def create_conversation(self, record: ConversationRecord) -> None:
        with self._tx() as cur:
            cur.execute(
                f"INSERT INTO conversations ({CONV_COLUMNS})"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
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
        self, cur: Cursor, tenant: str, conversation_id: str, lock: bool = False
    ) -> ConversationRecord | None:
        cur.execute(
            f"SELECT {CONV_COLUMNS} FROM conversations WHERE id = %s AND tenant = %s"
            " AND expires_at > %s" + (" FOR UPDATE" if lock else ""),
            (conversation_id, tenant, self.clock()),
        )
        row = cur.fetchone()
        return None if row is None else conversation_from_row(row)

    def get_conversation(self, tenant: str, conversation_id: str) -> ConversationRecord | None:
        with self._tx() as cur:
            return self._get_conversation(cur, tenant, conversation_id)

    def delete_conversation(self, tenant: str, conversation_id: str) -> bool:
        with self._tx() as cur:
            cur.execute(
                "DELETE FROM conversations WHERE id = %s AND tenant = %s AND expires_at > %s",
                (conversation_id, tenant, self.clock()),
            )
            return cur.rowcount == 1

    # ---------------------------------------------------------------------- upkeep

    def purge_expired(self) -> int:
        now = self.clock()
        removed = 0
        with self._tx() as cur:
            for table in ("generations", "idempotency_keys", "conversations"):
                cur.execute(
                    f"DELETE FROM {table} WHERE expires_at IS NOT NULL AND expires_at <= %s",
                    (now,),
                )
                removed += cur.rowcount
        return removed

    def close(self) -> None:
        with self._lock:
            self._conn.close()
