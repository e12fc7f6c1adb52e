"""Fixtures of the store tests (the session's PostgreSQL server is tests/conftest.py's)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.postgres import create_database, drop_database


@pytest.fixture
def postgres_url(postgres_server: str) -> Iterator[str]:
    """A fresh, empty database on the session's server (dropped afterwards)."""
    url = create_database(postgres_server)
    try:
        yield url
    finally:
        drop_database(postgres_server, url)
