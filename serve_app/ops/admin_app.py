"""The admin API: its own port (loopback by default) and its own key, never routed on the
public port.

The admin server is a deployment of the app (app.py), so every way of deploying the app
(`serve-app serve`, `serve run`, `serve deploy`) serves it, a redeploy moves it, and deleting
the app stops it. It reads the stats registry (`serve_app.ops.stats`) that engine replicas
report to; the ingress asks it whether the app is draining before admitting.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import threading
import time

from pydantic import ValidationError

from serve_app.access.keys import KeyRing, KeysFile, authorize_admin
from serve_app.openapi.admin import PATH as OPENAPI_PATH
from serve_app.openapi.admin import DrainRequest, admin_openapi_endpoint
from serve_app.ops.stats import RegistryHandle

logger = logging.getLogger(__name__)

# How long a new admin replica waits for the port (its predecessor's, on a redeploy).
BIND_TIMEOUT_S = 10.0
# How long the admin server may take to start listening once the port is bound.
START_TIMEOUT_S = 10.0


def build_admin_app(registry: RegistryHandle, api_key: str | None, keys: KeysFile | None = None):
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
        self.registry = RegistryHandle(model_id)
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
