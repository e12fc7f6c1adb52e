"""A client's deadline: the `X-Request-Timeout-Ms` header or a request's `timeout` field."""

from __future__ import annotations

from typing import Any

from serve_app import errors

TIMEOUT_HEADER = "x-request-timeout-ms"


def client_timeout_s(request: Any, req: Any) -> float | None:
    """The client's deadline: the `X-Request-Timeout-Ms` header or the `timeout` field
    (seconds); the stricter one wins when both are given."""
    timeout = getattr(req, "timeout", None)
    candidates = [timeout] if timeout else []
    header = request.headers.get(TIMEOUT_HEADER)
    if header is not None:
        try:
            ms = float(header)
        except ValueError:
            raise errors.invalid_request(f"{TIMEOUT_HEADER} must be a number", "timeout") from None
        if not ms > 0:
            raise errors.invalid_request(f"{TIMEOUT_HEADER} must be > 0", "timeout")
        candidates.append(ms / 1000.0)
    return min(candidates) if candidates else None
