"""Reading the admin port from tests."""

from __future__ import annotations

import time

import httpx


def engine_timeline(admin_url: str, request_id: str) -> dict:
    """The admin port's record of a finished request (replicas push it within ~0.2 s)."""
    deadline = time.monotonic() + 15
    while True:
        r = httpx.get(f"{admin_url}/admin/v1/requests/{request_id}", timeout=10)
        if r.status_code == 200:
            return r.json()
        assert r.status_code == 404 and time.monotonic() < deadline, r.text
        time.sleep(0.1)
