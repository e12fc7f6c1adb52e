"""Starlette exception handlers that answer every failure in the error shape."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse

from serve_app.errors.api_error import APIError, api_error_in
from serve_app.errors.constructors import internal_error, method_not_allowed, route_not_found


def of_exception(
    exc: BaseException, method: str, path: str, allowed: list[str] | None = None
) -> APIError:
    """What a route's exception answers: its APIError (unwrapped from Ray's wrappers), the
    router's 404 / 405 in the error shape (`allowed`: every method the path takes), or a 500
    `internal_error` (never plain text)."""
    from starlette.exceptions import HTTPException

    found = api_error_in(exc)
    if found is not None:
        return found
    if isinstance(exc, HTTPException):
        if exc.status_code == 404:
            return route_not_found(path)
        if exc.status_code == 405:
            if not allowed:
                allow = (exc.headers or {}).get("Allow", "")
                allowed = [m.strip() for m in allow.split(",") if m.strip()]
            return method_not_allowed(method, path, allowed)
        code = "invalid_request" if exc.status_code < 500 else "internal_error"
        return APIError(exc.status_code, code, str(exc.detail))
    return internal_error()


OnError = Callable[[Any, APIError, BaseException], None]


def exception_handlers(on_error: OnError | None = None) -> dict[Any, Any]:
    """Starlette `exception_handlers` that answer every failure in the error shape;
    `on_error(request, error, exc)` sees each one first (metrics, logs)."""
    from starlette.exceptions import HTTPException

    async def handle(request: Any, exc: Exception) -> JSONResponse:
        allowed = _allowed_methods(request) if isinstance(exc, HTTPException) else None
        error = of_exception(exc, request.method, request.url.path, allowed)
        if on_error is not None:
            on_error(request, error, exc)
        return error.response()

    # NOTE: Starlette hands `Exception` to its outermost middleware, which answers with this
    # handler and then re-raises (the server logs the traceback).
    return {APIError: handle, HTTPException: handle, Exception: handle}


def _allowed_methods(request: Any) -> list[str]:
    """Every method some route takes at this path: Starlette's own 405 names only the first
    route's, and a path may have one route per method."""
    from starlette.routing import Match

    methods: set[str] = set()
    for route in getattr(request.app, "routes", ()):
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)
