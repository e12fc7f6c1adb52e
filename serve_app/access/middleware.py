"""The first thing every request meets: authentication, the body-size cap, and the request's
usage meter. A plain ASGI middleware (not Starlette's BaseHTTPMiddleware), so streamed
responses and client disconnects pass through it unchanged and its `finally` runs after the
last byte of a stream or at a cancellation."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from serve_app import errors
from serve_app.access.budgets import LIMITER_STATE_KEY, Limiter
from serve_app.access.keys import OPEN_PRINCIPAL, PRINCIPAL_STATE_KEY, KeyRing, Principal

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Paths a load balancer probes without a key.
OPEN_PATHS = frozenset({"/health"})


def route_path(scope: Scope) -> str:
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class AccessMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        keyring: KeyRing | None,
        limiter: Limiter | None,
        max_body_bytes: int,
    ) -> None:
        self.app = app
        self.keyring = keyring
        self.limiter = limiter
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            principal = self.authenticate(scope)
            cap = self.body_cap(principal)
            check_content_length(scope, cap)
        except errors.APIError as exc:
            await reject(exc, scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state[PRINCIPAL_STATE_KEY] = principal
        if self.limiter is None:
            await self.app(scope, capped_receive(receive, cap), send)
            return
        state[LIMITER_STATE_KEY] = self.limiter
        token = self.limiter.start()
        try:
            await self.app(scope, capped_receive(receive, cap), self.limiter.settling(send))
        finally:
            self.limiter.finish(token)

    def authenticate(self, scope: Scope) -> Principal:
        if self.keyring is None or route_path(scope) in OPEN_PATHS:
            return OPEN_PRINCIPAL
        authorization = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        return self.keyring.authenticate(authorization)

    def body_cap(self, principal: Principal) -> int:
        key_cap = principal.limits.max_body_bytes
        return self.max_body_bytes if key_cap is None else min(key_cap, self.max_body_bytes)


def check_content_length(scope: Scope, cap: int) -> None:
    """A declared length over the cap is refused before a byte of the body is read."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                raise errors.invalid_request("Content-Length is not a number.") from None
            if declared > cap:
                raise errors.body_too_large(cap)


def capped_receive(receive: Receive, cap: int) -> Receive:
    """`receive` that raises 413 as soon as the body read so far passes `cap` (a chunked body
    declares no length), so an oversized body is never held whole."""
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > cap:
                raise errors.body_too_large(cap)
        return message

    return wrapped


async def reject(exc: errors.APIError, scope: Scope, receive: Receive, send: Send) -> None:
    response = exc.response()
    if exc.status == 401:
        response.headers["www-authenticate"] = "Bearer"
    await response(scope, receive, send)


def access_middleware(config: Any) -> Any:
    """The middleware for a ServeConfig's ingress. Without API keys every caller is the open
    principal and there are no per-key budgets, so nothing is metered."""
    from starlette.middleware import Middleware

    keyring = KeyRing(config.api_keys) if config.api_keys is not None else None
    return Middleware(
        AccessMiddleware,
        keyring=keyring,
        limiter=Limiter(config.model_id) if keyring is not None else None,
        max_body_bytes=config.limits.max_body_bytes,
    )
