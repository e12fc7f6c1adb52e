"""A throwaway PostgreSQL server for the tests, always stopped at the end.

`SERVE_APP_TEST_POSTGRES_URL` names an existing server (its role needs CREATEDB) instead.
Otherwise the `pgserver` wheel's bundled PostgreSQL starts in a temporary folder; as root it
runs the server as its own unprivileged system user, which it creates.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

URL_ENV = "SERVE_APP_TEST_POSTGRES_URL"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A connection URL of a PostgreSQL server for the session."""
    given = os.environ.get(URL_ENV)
    if given:
        yield given
        return
    import pgserver

    # NOTE: not under pytest's basetemp, which a concurrent pytest run may prune while the
    # server still runs there; and short, since the server's socket lives in it.
    pgdata = Path(tempfile.mkdtemp(prefix="serve-app-pg-"))
    try:
        server = pgserver.get_server(pgdata, cleanup_mode="stop")
        try:
            yield server.get_uri()
        finally:
            server.cleanup()
    finally:
        shutil.rmtree(pgdata, ignore_errors=True)


def with_database(url: str, name: str) -> str:
    """`url` (postgresql://...) naming the database `name` instead."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


def create_database(server_url: str) -> str:
    """A new empty database on the server; returns its URL."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    return with_database(server_url, name)


def drop_database(server_url: str, url: str) -> None:
    import psycopg

    name = urlsplit(url).path.lstrip("/")
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def postgres_url(postgres_server: str) -> Iterator[str]:
    """A fresh, empty database on the session's server (dropped afterwards)."""
    url = create_database(postgres_server)
    try:
        yield url
    finally:
        drop_database(postgres_server, url)
