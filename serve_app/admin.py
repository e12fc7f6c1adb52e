"""The admin API: its own port (loopback by default) and its own key, never routed on the
public port.

Engine replicas push their stats to a named registry actor a few times a second; the admin
server reads the registry, so it sees every replica (a Serve handle call would reach only
one). Draining is a flag in the same registry that the ingress consults before admitting.
Replicas push the engine timelines of requests that ended the same way (`serve_app.timelines`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import ray

from serve_app.auth import KeyRing, KeysFile, authorize_admin
from serve_app.named_actors import get_or_create
from serve_app.timelines import TimelineIndex

logger = logging.getLogger(__name__)

REGISTRY_NAMESPACE = "serve-app"
# A replica that has not reported for this long is gone (its entry is dropped).
STALE_AFTER_S = 3.0
# NOTE: the registry and the admin server live on the head node, like the HTTP proxy: a
# loopback bind must be the head's loopback, and GPU nodes may come and go.
HEAD_ONLY = {"node:__internal_head__": 0.001}
TOTALLED = ("kv_blocks_total", "kv_blocks_used", "running", "waiting", "held", "live_requests")


def registry_name(model_id: str) -> str:
    return f"stats:{model_id}"


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


class StatsReporter:
    """Runs in an engine replica: pushes `stats_fn()` to the registry every `period_s`, and
    the entries `timelines_fn()` returns (those new since its last call) when there are any."""

    def __init__(
        self, model_id: str, replica_id: str, stats_fn, period_s: float = 0.2, timelines_fn=None
    ):
        self.model_id, self.replica_id = model_id, replica_id
        self.stats_fn, self.period_s = stats_fn, period_s
        self.timelines_fn = timelines_fn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stats-reporter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        registry = None
        while not self._stop.wait(self.period_s):
            if registry is None:
                registry = find_registry(self.model_id)
                if registry is None:
                    continue
            try:
                registry.report.remote(self.replica_id, self.stats_fn())
                entries = self.timelines_fn() if self.timelines_fn is not None else None
                if entries:
                    registry.report_timelines.remote(self.replica_id, entries)
            except Exception:  # noqa: BLE001 (the registry went away; look it up again)
                registry = None

    def stop(self) -> None:
        self._stop.set()
        registry = find_registry(self.model_id)
        if registry is not None:
            registry.forget.remote(self.replica_id)


def build_admin_app(registry, api_key: str | None, keys: KeysFile | None = None):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from serve_app import errors

    keyring = KeyRing(keys) if keys is not None else None

    def authorize(request: Request) -> None:
        authorize_admin(request.headers.get("authorization"), api_key, keyring)

    async def stats(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse(await registry.snapshot.remote())

    async def request_timeline(request: Request) -> JSONResponse:
        """The engine timelines of a recent request (by X-Request-Id or engine request id):
        one entry per engine request (prompt, attempt), from every replica."""
        authorize(request)
        request_id = request.path_params["request_id"]
        entries = await registry.find_request.remote(request_id)
        if not entries:
            raise errors.not_found(
                "request_not_found",
                f"No recent request {request_id!r} (engines keep the last few hundred).",
            )
        return JSONResponse({"request_id": request_id, "engine_requests": entries})

    async def drain(request: Request) -> JSONResponse:
        """Stop admitting new requests (in-flight ones finish); `{"draining": false}` lifts it."""
        authorize(request)
        body = await request.body()
        draining = True
        if body:
            import json

            try:
                draining = bool(json.loads(body).get("draining", True))
            except (ValueError, AttributeError):
                raise errors.invalid_request('body must be {"draining": bool}') from None
        await registry.set_draining.remote(draining)
        return JSONResponse(await registry.snapshot.remote())

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, errors.APIError)
        return exc.response()

    return Starlette(
        routes=[
            Route("/admin/v1/stats", stats, methods=["GET"]),
            Route("/admin/v1/requests/{request_id:path}", request_timeline, methods=["GET"]),
            Route("/admin/v1/drain", drain, methods=["POST"]),
        ],
        exception_handlers={errors.APIError: on_api_error},
    )


class AdminServer:
    """A Ray actor serving the admin app with uvicorn on its own port."""

    def __init__(
        self,
        model_id: str,
        host: str,
        port: int,
        api_key: str | None,
        keys: KeysFile | None = None,
    ):
        import uvicorn

        registry = get_or_create_registry(model_id)
        app = build_admin_app(registry, api_key, keys)
        self.server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        )
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)
        self.thread.start()

    def ready(self) -> bool:
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        return bool(self.server.started)


def start_admin(
    model_id: str, host: str, port: int, api_key: str | None, keys: KeysFile | None = None
):
    """Start the registry and the admin server; returns the server actor (kill it to stop)."""
    get_or_create_registry(model_id)
    actor = (
        ray.remote(AdminServer)
        .options(num_cpus=0, resources=HEAD_ONLY)
        .remote(model_id, host, port, api_key, keys)
    )
    if not ray.get(actor.ready.remote()):
        raise RuntimeError(f"admin server did not start on {host}:{port}")
    return actor
