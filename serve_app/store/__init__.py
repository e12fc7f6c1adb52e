"""The durable store: its contract (`base`), portable SQL (`sql`), and the SQLite and
PostgreSQL backends; `open_store(url)` picks the backend (the backends import the contract,
never this package's factory)."""

from __future__ import annotations

import time
from pathlib import Path

from serve_app.store.base import Clock, Store


def open_store(url: str | None, data_dir: str | Path, clock: Clock = time.time) -> Store:
    """`None` or `sqlite:///PATH` -> SQLiteStore (default: DATA_DIR/serve-app.sqlite3);
    `postgresql://...` -> PostgresStore."""
    if url is None or url.startswith("sqlite:///"):
        from serve_app.store.sqlite import SQLiteStore

        default = Path(data_dir).expanduser() / "serve-app.sqlite3"
        return SQLiteStore(default if url is None else url.removeprefix("sqlite:///"), clock)
    if url.startswith(("postgresql://", "postgres://")):
        from serve_app.store.postgres import PostgresStore  # type: ignore[import-not-found]

        return PostgresStore(url, clock)
    raise ValueError(f"store: unsupported URL scheme in {url!r} (sqlite:/// or postgresql://)")
