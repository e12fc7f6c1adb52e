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


def wait_reporting(admin_url: str, num_replicas: int = 1, timeout_s: float = 30) -> dict:
    """The admin stats once every engine replica has reported. The admin server and the
    engines are replicas of one app that start side by side: an engine's first report lands
    a few tenths of a second after both are up."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = httpx.get(f"{admin_url}/admin/v1/stats", timeout=10).json()
        if len(stats["replicas"]) >= num_replicas:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


def replica_stat(admin_url: str, key: str) -> int:
    """One counter of the first engine replica's last report (the test servers run one)."""
    return httpx.get(f"{admin_url}/admin/v1/stats", timeout=10).json()["replicas"][0][key]


def wait_replica_stat(admin_url: str, key: str, minimum: int, timeout_s: float) -> int:
    """`replica_stat` once it reaches `minimum` (the replica reports a few times a second),
    or its last reading when `timeout_s` has passed: the caller asserts on what it needs."""
    deadline = time.monotonic() + timeout_s
    while (value := replica_stat(admin_url, key)) < minimum and time.monotonic() < deadline:
        time.sleep(0.1)
    return value
