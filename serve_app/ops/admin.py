"""The admin API: its own port (loopback by default) and its own key, never routed on the
public port.

The admin server is a deployment of the app (app.py), so every way of deploying the app
(`serve-app serve`, `serve run`, `serve deploy`) serves it, a redeploy moves it, and deleting
the app stops it. Engine replicas push their stats to a named registry actor a few times a
second; the admin server creates and reads the registry, so it sees every replica (a Serve
handle call would reach only one), and the registry dies with it. Draining is a flag in the
same registry that the ingress asks the admin deployment for before admitting. Replicas push
the engine timelines of requests that ended the same way (`serve_app.ops.timelines`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from pydantic import ValidationError

from serve_app.access.keys import KeyRing, KeysFile, authorize_admin
from serve_app.named_actors import get_or_create
from serve_app.openapi.admin import PATH as OPENAPI_PATH
from serve_app.openapi.admin import DrainRequest, admin_openapi_endpoint
from serve_app.ops.timelines import TimelineIndex

logger = logging.getLogger(__name__)

REGISTRY_NAMESPACE = "serve-app"
# A replica that has not reported for this long is gone (its entry is dropped).
STALE_AFTER_S = 3.0
# NOTE: the registry and the admin server live on the head node, like the HTTP proxy: a
# loopback bind must be the head's loopback, and GPU nodes may come and go.
HEAD_ONLY = {"node:__internal_head__": 0.001}
TOTALLED = ("kv_blocks_total", "kv_blocks_used", "running", "waiting", "held", "live_requests")
# How long a new admin replica waits for the port (its predecessor's, on a redeploy).
BIND_TIMEOUT_S = 10.0
# How long the admin server may take to start listening once the port is bound.
START_TIMEOUT_S = 10.0


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


class LiveRegistry:
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
        registry = last_report = None
        while not self._stop.wait(self.period_s):
            if registry is None:
                registry = find_registry(self.model_id)
                if registry is None:
                    continue
            try:
                # A report to a registry that has died fails only when read: read the last.
                if last_report is not None and ray.wait([last_report], timeout=0)[0]:
                    ray.get(last_report)
                last_report = registry.report.remote(self.replica_id, self.stats_fn())
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


def build_admin_app(registry: LiveRegistry, api_key: str | None, keys: KeysFile | None = None):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from serve_app import errors

    keyring = KeyRing(keys) if keys is not None else None
    is_keyed = api_key is not None or keyring is not None

    def authorize(request: Request) -> None:
        authorize_admin(request.headers.get("authorization"), api_key, keyring)

    async def stats(request: Request) -> JSONResponse:
        authorize(request)
        return JSONResponse(await registry.call(lambda r: r.snapshot.remote()))

    async def request_timeline(request: Request) -> JSONResponse:
        """The engine timelines of a recent request (by X-Request-Id or engine request id):
        one entry per engine request (prompt, attempt), from every replica."""
        authorize(request)
        request_id = request.path_params["request_id"]
        entries = await registry.call(lambda r: r.find_request.remote(request_id))
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
        try:
            draining = DrainRequest.model_validate_json(body or b"{}").draining
        except ValidationError:
            raise errors.invalid_request('body must be {"draining": bool}', "draining") from None
        await registry.call(lambda r: r.set_draining.remote(draining))
        return JSONResponse(await registry.call(lambda r: r.snapshot.remote()))

    return Starlette(
        routes=[
            Route("/admin/v1/stats", stats, methods=["GET"]),
            Route("/admin/v1/requests/{request_id:path}", request_timeline, methods=["GET"]),
            Route("/admin/v1/drain", drain, methods=["POST"]),
            Route(OPENAPI_PATH, admin_openapi_endpoint(is_keyed, authorize), methods=["GET"]),
        ],
        # The error shape for every failure; a 401 carries WWW-Authenticate (errors.py).
        exception_handlers=errors.exception_handlers(),
    )


def bind_listening(host: str, port: int, timeout_s: float) -> socket.socket:
    """A listening socket on host:port, waiting up to `timeout_s` while the port is in use
    (a replaced admin replica releases it as it stops)."""
    deadline = time.monotonic() + timeout_s
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(128)
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise RuntimeError(
                    f"admin_port: cannot listen on {host}:{port} ({exc.strerror})"
                ) from None
        time.sleep(0.25)


class AdminServer:
    """The admin deployment (app.py): the admin app served by uvicorn on a thread of its own,
    on its own port. Construction fails, naming the port, when it cannot listen."""

    def __init__(
        self,
        model_id: str,
        host: str,
        port: int,
        api_key: str | None,
        keys: KeysFile | None = None,
    ):
        import uvicorn

        sock = bind_listening(host, port, BIND_TIMEOUT_S)
        self.registry = LiveRegistry(model_id)
        app = build_admin_app(self.registry, api_key, keys)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[sock])),
            name="admin-http",
            daemon=True,
        )
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started and self.thread.is_alive():
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not self.server.started:
            self.close()
            raise RuntimeError(f"admin server did not start on {host}:{port}")
        logger.info("admin API on http://%s:%d/admin/v1/stats", host, port)

    async def is_draining(self) -> bool:
        return await self.registry.call(lambda r: r.is_draining.remote())

    def check_health(self) -> None:
        """Serve's health check: a server thread that ended takes the replica down."""
        if not self.thread.is_alive():
            raise RuntimeError("the admin HTTP server stopped")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)

    def __del__(self) -> None:
        # Serve calls this as the replica stops: the port is free for the next replica.
        if hasattr(self, "thread"):
            self.close()
