"""PostgreSQL backend of the Store: the same schema and contract as SQLiteStore, for clusters
where any ingress replica (on any node) may serve any read.

Concurrency across processes: an idempotency claim takes a transaction-level advisory lock
on its (tenant, operation, key), so concurrent claims serialise and exactly one creates; a
conversation turn locks its conversation row (`FOR UPDATE`). Every method is one transaction
that has committed when the method returns (PostgreSQL's default synchronous commit).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from serve_app.store.base import Clock, IdempotencyKey
from serve_app.store.sql import SQL, SQLStore

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
        items TEXT NOT NULL, pending_generation TEXT,
        created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL, metadata TEXT NOT NULL DEFAULT '{}')""",
    """CREATE TABLE IF NOT EXISTS owners (
        owner TEXT PRIMARY KEY, heartbeat_at DOUBLE PRECISION NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS responses (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, status TEXT NOT NULL, data TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL, expires_at DOUBLE PRECISION NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS response_events (
        tenant TEXT NOT NULL, response_id TEXT NOT NULL, seq INTEGER NOT NULL,
        data TEXT NOT NULL, PRIMARY KEY (tenant, response_id, seq))""",
]
# Advisory lock ids: schema creation (concurrent CREATE ... IF NOT EXISTS can still collide).
SCHEMA_LOCK = 7_324_001
CONNECT_TIMEOUT_S = 10

Cursor = psycopg.Cursor[Any]


class _Cursor:
    """A psycopg cursor taking the `?` placeholders of the shared SQL."""

    def __init__(self, cur: Cursor) -> None:
        self.cur = cur

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> Cursor:
        return self.cur.execute(sql.replace("?", "%s"), params)


class PostgresStore(SQLStore):
    """One connection per store, shared by the caller's threads under a lock (as SQLiteStore);
    a broken connection is replaced on the next call."""

    ROW_LOCK = " FOR UPDATE"

    def __init__(self, url: str, clock: Clock = time.time) -> None:
        super().__init__(clock)
        self.url = url
        self._lock = threading.Lock()
        self._conn = self._connect()
        with self._tx() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
            for statement in SCHEMA:
                cur.execute(statement)
            cur.execute(
                "SELECT column_name FROM information_schema.columns"
                " WHERE table_schema = current_schema() AND table_name = 'conversations'"
            )
            columns = {row[0] for row in cur.fetchall()}
            self._migrate_conversations(_Cursor(cur), columns)

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

    @contextmanager
    def _write(self) -> Iterator[_Cursor]:
        with self._tx() as cur:
            yield _Cursor(cur)

    _read = _write

    def _lock_claim(self, db: SQL, tenant: str, key: IdempotencyKey) -> None:
        claim = f"{tenant}\x1f{key.operation}\x1f{key.key}"
        db.execute("SELECT pg_advisory_xact_lock(hashtextextended(?, 0))", (claim,))

    def close(self) -> None:
        with self._lock:
            self._conn.close()
