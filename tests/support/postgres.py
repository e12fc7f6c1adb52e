"""Databases on the tests' PostgreSQL server (the `postgres_server` fixture in
tests/conftest.py, which reads `URL_ENV`)."""

from __future__ import annotations

import uuid
from urllib.parse import urlsplit, urlunsplit

URL_ENV = "SERVE_APP_TEST_POSTGRES_URL"


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
