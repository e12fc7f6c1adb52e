"""Which streamed responses' clients stopped reading, shared by proxies and engine replicas.

Proxies write to the board (`serve_app.backpressure.proxy_hold`): `pause(key)` while a write
to the client is stuck, `resume(key)` once it went through. Engine replicas long-poll it
(`watch`) and hold the requests of paused keys. A pause is a lease: a proxy that died
mid-stall stops renewing it, and the key resumes within `LEASE_S` plus one watch period.

One board per app, a named actor created by the first engine replica that needs it and
owned by that replica; when its owner goes, the others create it again and proxies look it
up again (pauses still wanted are re-asserted by their proxies' heartbeats).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from serve_app.named_actors import get_or_create

logger = logging.getLogger(__name__)

BOARD_NAMESPACE = "serve-app"
LEASE_S = 5.0
WATCH_S = 5.0


def board_name(app_id: str) -> str:
    return f"flow:{app_id}"


class StalledStreams:
    def __init__(self, lease_s: float = LEASE_S):
        self.lease_s = lease_s
        self._paused: dict[str, float] = {}  # flow key -> lease end (monotonic)
        self._version = 0
        self._changed: asyncio.Event | None = None

    async def pause(self, key: str) -> None:
        is_new = key not in self._paused
        self._paused[key] = time.monotonic() + self.lease_s
        if is_new:
            self._bump()

    async def resume(self, key: str) -> None:
        if self._paused.pop(key, None) is not None:
            self._bump()

    async def watch(self, version: int, timeout_s: float) -> tuple[int, list[str]]:
        """The paused keys, once the board's version differs from `version` (or after
        `timeout_s`, when expired leases are dropped)."""
        self._expire()
        if version == self._version:
            try:
                await asyncio.wait_for(self._event().wait(), timeout_s)
            except TimeoutError:
                self._expire()
        return self._version, sorted(self._paused)

    def _expire(self) -> None:
        now = time.monotonic()
        expired = [k for k, until in self._paused.items() if until < now]
        for key in expired:
            del self._paused[key]
        if expired:
            self._bump()

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _bump(self) -> None:
        self._version += 1
        self._event().set()
        self._changed = asyncio.Event()


def get_or_create_stalled_streams(app_id: str) -> Any:
    return get_or_create(StalledStreams, board_name(app_id), BOARD_NAMESPACE)


class StallWatcher:
    """An engine replica's side of the board: tracks the flow keys of its live requests and
    calls `set_paused(engine_request_id, paused)` as the board pauses and resumes them.
    It watches the board from its first tracked key until `stop` (one long poll per
    `WATCH_S` when idle), so requests pay no set-up. Lives on the replica's event loop."""

    def __init__(self, app_id: str, set_paused: Callable[[str, bool], None]):
        self.app_id = app_id
        self._set_paused = set_paused
        self._requests: dict[str, set[str]] = {}  # flow key -> engine request ids
        self._paused: set[str] = set()
        self._board: Any = None
        self._task: asyncio.Task | None = None

    def track(self, key: str, request_id: str) -> None:
        self._requests.setdefault(key, set()).add(request_id)
        if key in self._paused:
            self._set_paused(request_id, True)
        if self._task is None:
            self._task = asyncio.create_task(self._watch())

    def untrack(self, key: str, request_id: str) -> None:
        ids = self._requests.get(key)
        if ids is not None:
            ids.discard(request_id)
            if not ids:
                del self._requests[key]

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def apply(self, paused: set[str]) -> None:
        """The board's paused keys: pause what newly is, resume what no longer is."""
        for key, now_paused in [(k, True) for k in paused - self._paused] + [
            (k, False) for k in self._paused - paused
        ]:
            for request_id in self._requests.get(key, ()):
                self._set_paused(request_id, now_paused)
        self._paused = paused

    async def _watch(self) -> None:
        version = -1
        while True:
            try:
                if self._board is None:
                    self._board = await asyncio.to_thread(
                        get_or_create_stalled_streams, self.app_id
                    )
                version, keys = await self._board.watch.remote(version, WATCH_S)
                self.apply(set(keys))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (the board's owner went: make it again)
                logger.warning("flow board unreachable (%s); retrying", type(exc).__name__)
                self._board, version = None, -1
                await asyncio.sleep(1.0)
