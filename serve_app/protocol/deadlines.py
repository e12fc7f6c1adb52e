"""A client's deadline: the `X-Request-Timeout-Ms` header or a request's `timeout` field."""

from __future__ import annotations

from typing import Any

from serve_app import errors

TIMEOUT_HEADER = "x-request-timeout-ms"
# How an error names the header as its `param` (a field is named by its own name, `timeout`).
HEADER_PARAM = "X-Request-Timeout-Ms"
FIELD_PARAM = "timeout"


def client_timeout_s(request: Any, req: Any) -> float | None:
    """The client's deadline: the `X-Request-Timeout-Ms` header or the `timeout` field
    (seconds); the stricter one wins when both are given."""
    timeout = getattr(req, "timeout", None)
    candidates = [timeout] if timeout else []
    header_s = _header_s(request)
    if header_s is not None:
        candidates.append(header_s)
    return min(candidates) if candidates else None


def deadline_param(request: Any, req: Any) -> str:
    """Where the deadline `client_timeout_s` chose was set: the `param` of its errors."""
    timeout = getattr(req, "timeout", None)
    header_s = _header_s(request)
    if header_s is not None and not (timeout and timeout < header_s):
        return HEADER_PARAM
    return FIELD_PARAM


def _header_s(request: Any) -> float | None:
    header = request.headers.get(TIMEOUT_HEADER)
    if header is None:
        return None
    try:
        ms = float(header)
    except ValueError:
        raise errors.invalid_request(f"{HEADER_PARAM} must be a number", HEADER_PARAM) from None
    if not ms > 0:
        raise errors.invalid_request(f"{HEADER_PARAM} must be > 0", HEADER_PARAM)
    return ms / 1000.0
