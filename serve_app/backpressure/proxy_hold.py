"""Backpressure across Serve's proxy: the client's socket, seen where it is written.

Serve 2.60's proxy reads every replica stream eagerly and has no backpressure towards the
replica, so a client that stops reading is invisible to the ingress and to the engine. The
one place that sees it is the proxy's own socket write: uvicorn's `send` waits while the
connection's write buffer is over its high-water mark (64 KiB, after the kernel's socket
buffers are full). `ProxyHoldMiddleware` runs inside the proxy, installed through Serve's
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` hook, and times those writes (those that can wait:
uvicorn waits only while the transport is paused):

- a body write still waiting after `STALL_S` pauses the response's flow key on its board
  (`serve_app.backpressure.stalled_streams`), and keeps re-asserting it every `HEARTBEAT_S` while
  it waits;
- the write completing resumes the key.

Engine replicas watch the board and hold the paused key's requests (not scheduled, KV kept;
the hold deadline still applies), so nothing more is produced while the client is away and
nothing piles up in the ingress or the proxy. Only responses whose ingress named a flow key
in the internal `FLOW_HEADER` take part; the header never reaches the client.

This module runs in the proxy process: it imports neither torch nor the engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any
from urllib.parse import quote, unquote

logger = logging.getLogger(__name__)

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK_PATH = "serve_app.backpressure.proxy_hold.proxy_middlewares"
FLOW_HEADER = "x-serve-app-flow"
# Logged once per deploy (by the ingress; by `serve-app serve` too) where the head lacks it.
MISSING_HOOK_WARNING = (
    f"Serve's proxy runs without our hook ({CALLBACK_ENV} is not {CALLBACK_PATH} in the "
    "head's `ray start` environment): a client that stops reading is held only when its "
    "engine window fills, and /-/routes answers without a key check (docs/deploy.md)"
)
_FLOW_HEADER_BYTES = FLOW_HEADER.encode()
# A body write that has not returned after this long found the client's socket full.
STALL_S = 0.2
# While the write still waits, the pause is re-asserted this often (it is a lease).
HEARTBEAT_S = 1.0
# A flow-keyed response's socket send buffer (Linux doubles it) and its transport's write
# high-water mark. Left to autotuning, loopback send buffers grow to megabytes: a stalled
# client would go unnoticed for a whole response. Token streams need far less.
SOCKET_SNDBUF_BYTES = 32 * 1024
WRITE_HIGH_WATER_BYTES = 32 * 1024


def is_enabled() -> bool:
    """Whether this node's proxy runs the middleware (its raylet gave it this environment)."""
    return os.environ.get(CALLBACK_ENV) == CALLBACK_PATH


def proxy_middlewares() -> list[Any]:
    """Serve's proxy callback: the middlewares to wrap the proxy's ASGI app with (Serve wraps
    in list order, so the last is outermost: `/-/routes` is refused before anything runs)."""
    from starlette.middleware import Middleware

    from serve_app.access.proxy_keys import RoutesGuard

    return [Middleware(ProxyHoldMiddleware), Middleware(RoutesGuard)]


def flow_header(board: str, key: str) -> tuple[str, str]:
    """The ingress's response header naming the board and the flow key of a stream."""
    return FLOW_HEADER, f"{quote(board, safe='')} {key}"


class ProxyHoldMiddleware:
    def __init__(self, app: Any):
        self.app = app
        self._boards: dict[str, Any] = {}
        # Board calls in flight (kept referenced until they finish).
        self._calls: set[asyncio.Task] = set()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        flow = _ResponseFlow(self, send)
        try:
            await self.app(scope, receive, flow.send)
        finally:
            flow.close()

    def post(self, board: str, key: str, paused: bool, after: asyncio.Task | None) -> asyncio.Task:
        """Tell the board; `after` (the flow's previous call) lands first, so a resume never
        overtakes its pause."""
        task = asyncio.ensure_future(self._post(board, key, paused, after))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)
        return task

    async def _post(self, board: str, key: str, paused: bool, after: asyncio.Task | None) -> None:
        if after is not None:
            await asyncio.wait([after])
        try:
            handle = self._boards.get(board)
            if handle is None:
                handle = self._boards[board] = await asyncio.to_thread(_lookup_board, board)
            await (handle.pause if paused else handle.resume).remote(key)
        except Exception as exc:  # noqa: BLE001 (the board restarts with its owner; retried)
            self._boards.pop(board, None)
            logger.warning("flow board %s unreachable: %s", board, type(exc).__name__)


def _lookup_board(board: str) -> Any:
    import ray

    from serve_app.backpressure.stalled_streams import BOARD_NAMESPACE

    return ray.get_actor(board, namespace=BOARD_NAMESPACE)


def _bound_buffers(send: Any) -> None:
    """Cap the connection's send buffers, when the server is uvicorn (Serve's): its `send` is
    bound to the request cycle, which holds the transport. Elsewhere the kernel's own
    buffers apply and a stall is seen later."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_SNDBUF_BYTES)
        except OSError as exc:  # a socket that refuses keeps the kernel's buffers
            logger.debug("SO_SNDBUF not set: %s", exc)
    # Resume writing once half the buffer drained (asyncio's default is a quarter): a slow
    # reader is resumed sooner, well inside its hold deadline.
    transport.set_write_buffer_limits(high=WRITE_HIGH_WATER_BYTES, low=WRITE_HIGH_WATER_BYTES // 2)


def _write_flow(send: Any) -> Any:
    """uvicorn's flow control for the connection `send` writes to (its request cycle holds
    it, as it holds the transport), or None where the server is another."""
    flow = getattr(getattr(send, "__self__", None), "flow", None)
    return flow if isinstance(getattr(flow, "write_paused", None), bool) else None


class _ResponseFlow:
    """One response's writes: finds its flow key, and pauses it while a write is stuck."""

    def __init__(self, middleware: ProxyHoldMiddleware, send: Any):
        self._middleware = middleware
        self._send = send
        self._board: str | None = None
        self._key: str | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._last_call: asyncio.Task | None = None
        # uvicorn's flow control of the connection (`write_paused`), when the server is it.
        self._flow: Any = None
        self.paused = False

    async def send(self, message: dict) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            message = self._take_header(message)
            if self._key is not None:
                _bound_buffers(self._send)
                self._flow = _write_flow(self._send)
        if self._key is None or kind != "http.response.body":
            await self._send(message)
            return
        if not self.paused and self._flow is not None and not self._flow.write_paused:
            # uvicorn waits only before a write, and only while its transport is paused:
            # this one cannot stall, so it needs no timer (one per token otherwise).
            await self._send(message)
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(STALL_S, self._stalled)
        try:
            await self._send(message)
        finally:
            self._timer.cancel()
            self._timer = None
            if self.paused:
                self._set(False)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.paused:
            self._set(False)

    def _take_header(self, message: dict) -> dict:
        headers = message.get("headers") or []
        kept = []
        for name, value in headers:
            if name.lower() == _FLOW_HEADER_BYTES:
                board, _, key = value.decode("latin-1").partition(" ")
                self._board, self._key = unquote(board), key
            else:
                kept.append((name, value))
        if len(kept) == len(headers):
            return message
        return {**message, "headers": kept}

    def _stalled(self) -> None:
        """The write is still waiting: the client stopped reading (re-asserted each beat)."""
        assert self._board is not None and self._key is not None
        if not self.paused:
            logger.info("client stopped reading: flow %s paused", self._key)
        self._set(True)
        self._timer = asyncio.get_running_loop().call_later(HEARTBEAT_S, self._stalled)

    def _set(self, paused: bool) -> None:
        assert self._board is not None and self._key is not None
        self.paused = paused
        self._last_call = self._middleware.post(self._board, self._key, paused, self._last_call)
