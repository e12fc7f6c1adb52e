"""The SQLite backend of the Store: one file in WAL mode (the default, in a local data
folder). Every write transaction takes the write lock up front (BEGIN IMMEDIATE), so the
threads of one process and several processes on one host stay consistent; FULL sync makes a
commit survive power loss, not only a process crash."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from serve_app.store.base import Clock
from serve_app.store.sql import SQLStore

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
    items TEXT NOT NULL, pending_generation TEXT, created_at REAL NOT NULL,
    updated_at REAL NOT NULL, expires_at REAL NOT NULL, metadata TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS owners (owner TEXT PRIMARY KEY, heartbeat_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, status TEXT NOT NULL, data TEXT NOT NULL,
    created_at REAL NOT NULL, expires_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS response_events (
    tenant TEXT NOT NULL, response_id TEXT NOT NULL, seq INTEGER NOT NULL, data TEXT NOT NULL,
    PRIMARY KEY (tenant, response_id, seq)
);
"""


# Generation records hold prompts and outputs: only the server's own user may read them.
FILE_MODE = 0o600
DIR_MODE = 0o700
COMPANIONS = ("-wal", "-shm", "-journal")


def create_private(path: Path) -> None:
    """The database file (and the folders made for it) readable by this user only; an
    existing file and its WAL companions are narrowed to that, too."""
    for folder in reversed([p for p in path.parents if not p.exists()]):
        folder.mkdir(mode=DIR_MODE)
        os.chmod(folder, DIR_MODE)  # the umask may have taken bits off: set, not mask
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, FILE_MODE))
    for file in [path, *(path.with_name(path.name + suffix) for suffix in COMPANIONS)]:
        if file.exists():
            os.chmod(file, FILE_MODE)


class SQLiteStore(SQLStore):
    """One SQLite file in WAL mode; safe for the threads of one process and for several
    processes on one host (each write transaction takes the write lock up front)."""

    def __init__(self, path: str | Path, clock: Clock = time.time) -> None:
        super().__init__(clock)
        self.path = Path(path)
        create_private(self.path)
        # isolation_level=None: we issue BEGIN IMMEDIATE / COMMIT ourselves.
        self._db = sqlite3.connect(
            self.path, isolation_level=None, check_same_thread=False, timeout=30.0
        )
        self._lock = threading.Lock()
        # SQLite gives the -wal and -shm files the database file's mode (0600).
        self._db.execute("PRAGMA journal_mode=WAL")
        # FULL: a commit survives power loss, not only a process crash.
        self._db.execute("PRAGMA synchronous=FULL")
        with self._write() as db:
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            columns = {row[1] for row in db.execute("PRAGMA table_info(conversations)")}
            self._migrate_conversations(db, columns)

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

    def close(self) -> None:
        with self._lock:
            self._db.close()
