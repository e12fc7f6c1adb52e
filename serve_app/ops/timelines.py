"""Engine timelines of recent requests, for operators: when each engine request arrived, began
prefill, got its grammar, produced its first token and finished.

An engine replica keeps the last `CAPACITY` in a `TimelineRing` and hands new ones to its
stats reporter, which pushes them to the registry (`serve_app.ops.stats`); the registry's
`TimelineIndex` keeps `CAPACITY` per replica, so `GET /admin/v1/requests/{id}` finds a request
whichever replica ran it. The id is the client-visible `X-Request-Id` (Serve's request id,
which Serve carries from the ingress into the engine call) or the engine request id.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from actors.messages import EngineRequest
from actors.outputs import RequestOutput

CAPACITY = 256
# Replicas whose timelines the registry keeps (replaced replicas age out, oldest first).
MAX_REPLICAS = 64


def client_request_id() -> str:
    """The Serve request id of the call being served ("" outside a Serve request)."""
    try:
        from ray.serve.context import _get_serve_request_context

        return _get_serve_request_context().request_id or ""
    except Exception:  # noqa: BLE001 (outside a Serve replica)
        return ""


class TimelineRing:
    """One engine replica's recent requests. `watch` runs on the replica's event loop;
    `take_new` on the stats reporter's thread."""

    def __init__(self, replica_id: str, capacity: int = CAPACITY):
        self.replica_id = replica_id
        self.entries: deque[dict[str, Any]] = deque(maxlen=capacity)
        self.unsent: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    async def watch(
        self, request: EngineRequest, outputs: AsyncGenerator[RequestOutput, None]
    ) -> AsyncIterator[RequestOutput]:
        """Pass `outputs` through; record the request when it ends (or its reader leaves)."""
        received_at, started = time.time(), time.monotonic()
        num_output_tokens, last = 0, None
        try:
            async with aclosing(outputs):  # a reader that leaves closes the engine stream now
                async for out in outputs:
                    num_output_tokens += sum(len(d.token_ids) for d in out.deltas)
                    last = out
                    yield out
        finally:
            entry = {
                "request_id": client_request_id(),
                "engine_request_id": request.request_id,
                "attempt": request.attempt,
                "replica": self.replica_id,
                "received_at": received_at,
                "has_grammar": bool(request.grammar),
                "num_prompt_tokens": len(request.prompt_token_ids),
                "num_output_tokens": num_output_tokens,
                "num_cached_tokens": last.num_cached_tokens if last is not None else 0,
                "finished": bool(last is not None and last.finished),
                "finish_reason": _finish_reason(last),
                "error_code": last.error_code if last is not None else None,
                "timeline": _timeline(last, started),
            }
            self.add(entry)

    def add(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self.entries.append(entry)
            self.unsent.append(entry)

    def take_new(self) -> list[dict[str, Any]]:
        """Entries recorded since the last call (at most `capacity`)."""
        with self._lock:
            new = list(self.unsent)
            self.unsent.clear()
        return new

    def lookup(self, request_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.entries if _matches(e, request_id)]


class TimelineIndex:
    """The registry's side: the last `capacity` entries of each of the latest replicas."""

    def __init__(self, capacity: int = CAPACITY, max_replicas: int = MAX_REPLICAS):
        self.capacity, self.max_replicas = capacity, max_replicas
        self.replicas: OrderedDict[str, deque[dict[str, Any]]] = OrderedDict()

    def add(self, replica_id: str, entries: list[dict[str, Any]]) -> None:
        ring = self.replicas.get(replica_id)
        if ring is None:
            ring = self.replicas[replica_id] = deque(maxlen=self.capacity)
        self.replicas.move_to_end(replica_id)
        ring.extend(entries)
        while len(self.replicas) > self.max_replicas:
            self.replicas.popitem(last=False)

    def lookup(self, request_id: str) -> list[dict[str, Any]]:
        """Every engine request (prompt, attempt) of this id, oldest first."""
        found = [e for ring in self.replicas.values() for e in ring if _matches(e, request_id)]
        return sorted(found, key=lambda e: e["received_at"])


def _matches(entry: dict[str, Any], request_id: str) -> bool:
    return request_id in (entry["request_id"], entry["engine_request_id"])


def _finish_reason(last: RequestOutput | None) -> str | None:
    if last is None or not last.deltas:
        return None
    reason = last.deltas[0].finish_reason
    return reason.value if reason is not None else None


def _timeline(last: RequestOutput | None, started: float) -> dict[str, float | None]:
    """Seconds from the request's arrival in the engine: prefill began (`scheduled_s`), its
    grammar was attached, sample 0's first token. The replica's own times, from receiving the
    request (`started`, on the monotonic clock the engine shares): `engine_arrival_s`, the
    wait before the engine took it (the step in progress ends first), and `finished_s`, the
    end of its stream. A client's time to first token is its own path to the replica, plus
    `engine_arrival_s` and `first_token_s`, plus the first token's way back."""
    engine = (last.timeline if last is not None else None) or {}
    arrived_at = engine.get("arrived_at")
    return {
        "arrival_s": 0.0,
        "engine_arrival_s": arrived_at - started if arrived_at is not None else None,
        "scheduled_s": engine.get("scheduled_s"),
        "grammar_ready_s": engine.get("grammar_ready_s"),
        "first_token_s": engine.get("first_token_s"),
        "finished_s": time.monotonic() - started,
    }
