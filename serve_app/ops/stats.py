"""The stats registry: what every engine replica reports, read by the admin API.

Engine replicas push their stats to a named registry actor a few times a second while
they change, once a second while they do not (`StatsReporter`, a thread in each replica),
and the engine timelines of requests that ended the same way (`serve_app.ops.timelines`).
The admin server creates and reads the registry, so it sees every replica (a Serve handle
call would reach only one), and the registry dies with it. Draining is a flag in the same
registry.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import ray

from serve_app.named_actors import get_or_create
from serve_app.ops.timelines import TimelineIndex

REGISTRY_NAMESPACE = "serve-app"
# A replica that has not reported for this long is gone (its entry is dropped).
STALE_AFTER_S = 3.0
# An engine replica whose stats did not change pushes them again this often.
HEARTBEAT_S = 1.0
# NOTE: the registry and the admin server live on the head node, like the HTTP proxy: a
# loopback bind must be the head's loopback, and GPU nodes may come and go.
HEAD_ONLY = {"node:__internal_head__": 0.001}
TOTALLED = (
    "kv_blocks_total",
    "kv_blocks_used",
    "running",
    "waiting",
    "held",
    "live_requests",
    "requests_total",
    "steps_total",
)


def registry_name(model_id: str) -> str:
    return f"stats:{model_id}"


class ReportChanges:
    """When a replica's stats are worth a push: when they changed since the last one, or
    when `heartbeat_s` passed (the registry drops a replica silent for `STALE_AFTER_S`)."""

    def __init__(self, heartbeat_s: float) -> None:
        self.heartbeat_s = heartbeat_s
        self.reset()

    def reset(self) -> None:
        self._last: dict[str, Any] | None = None
        self._sent_at = 0.0

    def due(self, stats: dict[str, Any], now: float) -> bool:
        if stats == self._last and now - self._sent_at < self.heartbeat_s:
            return False
        self._last, self._sent_at = stats, now
        return True


class StatsRegistry:
    def __init__(self) -> None:
        self.replicas: dict[str, tuple[float, dict[str, Any]]] = {}
        self.draining = False
        self.timelines = TimelineIndex()

    def report(self, replica_id: str, stats: dict[str, Any]) -> None:
        self.replicas[replica_id] = (time.monotonic(), stats)

    def report_timelines(self, replica_id: str, entries: list[dict[str, Any]]) -> None:
        self.timelines.add(replica_id, entries)

    def find_request(self, request_id: str) -> list[dict[str, Any]]:
        return self.timelines.lookup(request_id)

    def forget(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        for rid, (seen, _) in list(self.replicas.items()):
            if now - seen > STALE_AFTER_S:
                del self.replicas[rid]
        replicas = [{"replica": rid, **stats} for rid, (_, stats) in sorted(self.replicas.items())]
        total = {k: sum(int(r.get(k, 0)) for r in replicas) for k in TOTALLED}
        return {"replicas": replicas, "total": total, "draining": self.draining}

    def set_draining(self, draining: bool) -> bool:
        self.draining = draining
        return draining

    def is_draining(self) -> bool:
        return self.draining


def get_or_create_registry(model_id: str):
    return get_or_create(
        StatsRegistry, registry_name(model_id), REGISTRY_NAMESPACE, resources=HEAD_ONLY
    )


def find_registry(model_id: str):
    try:
        return ray.get_actor(registry_name(model_id), namespace=REGISTRY_NAMESPACE)
    except ValueError:
        return None


class RegistryHandle:
    """The registry as the admin server uses it. The registry lives as long as the process
    that created it, and a redeployed admin replica may find its predecessor's: a call that
    finds it gone creates the next one and is made once more."""

    def __init__(self, model_id: str):
        self.model_id = model_id
        self.handle = get_or_create_registry(model_id)

    async def call(self, method: Callable[[Any], Awaitable[Any]]) -> Any:
        try:
            return await method(self.handle)
        except ray.exceptions.RayActorError:
            self.handle = get_or_create_registry(self.model_id)
            return await method(self.handle)


class StatsReporter:
    """Runs in an engine replica: reads `stats_fn()` every `period_s` and pushes it to the
    registry when it changed, or when `HEARTBEAT_S` passed since the last push (an idle
    replica's stats do not change, and each push is a Ray call); `on_report(stats)` runs with
    each push (the replica's gauges). The entries `timelines_fn()` returns (those new since
    its last call) are pushed whenever there are any."""

    def __init__(
        self,
        model_id: str,
        replica_id: str,
        stats_fn,
        period_s: float = 0.2,
        timelines_fn=None,
        on_report=None,
    ):
        self.model_id, self.replica_id = model_id, replica_id
        self.stats_fn, self.period_s = stats_fn, period_s
        self.timelines_fn = timelines_fn
        self.on_report = on_report
        self.changes = ReportChanges(HEARTBEAT_S)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stats-reporter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        registry = last_report = None
        while not self._stop.wait(self.period_s):
            if registry is None:
                registry = find_registry(self.model_id)
                if registry is None:
                    continue
                self.changes.reset()
            try:
                # A report to a registry that has died fails only when read: read the last.
                if last_report is not None and ray.wait([last_report], timeout=0)[0]:
                    ray.get(last_report)
                stats = self.stats_fn()
                if self.changes.due(stats, time.monotonic()):
                    last_report = registry.report.remote(self.replica_id, stats)
                    if self.on_report is not None:
                        self.on_report(stats)
                entries = self.timelines_fn() if self.timelines_fn is not None else None
                if entries:
                    registry.report_timelines.remote(self.replica_id, entries)
            except Exception:  # noqa: BLE001 (the registry went away; look it up again)
                registry = last_report = None

    def stop(self) -> None:
        self._stop.set()
        registry = find_registry(self.model_id)
        if registry is not None:
            registry.forget.remote(self.replica_id)
