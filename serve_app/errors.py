"""The error taxonomy: one JSON shape, one status per class, retry headers clients obey.

Every error body is `{"error": {"message", "type", "code", "param"}}`. `type` follows the
HTTP status (OpenAI's names where OpenAI has one); `code` names the exact cause.

| status | type                    | client should                 | codes                        |
|--------|-------------------------|-------------------------------|------------------------------|
| 400    | invalid_request_error   | fix the request               | invalid_request,             |
|        |                         |                               | unknown_parameter,           |
|        |                         |                               | unsupported_parameter,       |
|        |                         |                               | invalid_grammar,             |
|        |                         |                               | context_length_exceeded,     |
|        |                         |                               | max_tokens_exceeded,         |
|        |                         |                               | deadline_too_short,          |
|        |                         |                               | request_limit_exceeded,      |
|        |                         |                               | model_not_allowed,           |
|        |                         |                               | output_format_not_allowed    |
| 401    | authentication_error    | fix credentials               | invalid_api_key              |
| 403    | permission_error        | fix credentials / permissions | model_not_permitted,         |
|        |                         |                               | profile_not_permitted,       |
|        |                         |                               | admin_not_permitted          |
| 404    | not_found_error         | stop (it does not exist)      | model_not_found,             |
|        |                         |                               | generation_not_found,        |
|        |                         |                               | conversation_not_found,      |
|        |                         |                               | profile_not_found,           |
|        |                         |                               | request_not_found (admin),   |
|        |                         |                               | not_found (unknown route)    |
| 405    | invalid_request_error   | fix the method                | method_not_allowed (+ Allow) |
| 409    | conflict_error          | stop retrying this id         | request_id_in_use,           |
|        |                         |                               | idempotency_key_reused,      |
|        |                         |                               | stale_revision               |
| 413    | invalid_request_error   | shrink the body               | body_too_large               |
| 422    | invalid_request_error   | shrink (generations API)      | context_length_exceeded,     |
|        |                         |                               | max_tokens_exceeded          |
| 429    | rate_limit_error        | shed load, honour Retry-After | concurrency_limit,           |
|        |                         |                               | token_rate_limit             |
| 500    | server_error            | retry only if idempotent      | internal_error               |
| 503    | overloaded_error        | back off, retry elsewhere     | overloaded,                  |
|        |                         |                               | deadline_unmeetable          |

Retry headers: the official `openai` client retries 408/409/429/5xx on its own unless told
`x-should-retry: false`. So every 4xx and every non-repeatable 500 says `false`; 429 and 503
say `true` and carry `Retry-After` (whole seconds, at least 1). A 401 names its scheme in
`WWW-Authenticate: Bearer`.

An APIError crosses Ray (a deployment or actor raising it to its caller) whole: it pickles
with every field, and `api_error_in` finds it inside Ray's wrappers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse

# Status -> OpenAI-style `type`; one fact, used by every constructor below.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "overloaded_error",
}

NO_RETRY = {"x-should-retry": "false"}
# Client text echoed in a message (a model name, a path) is cut to this many characters.
MAX_ECHO_CHARS = 256


class APIError(Exception):
    """An error the API reports to its caller; raise it anywhere before headers are sent."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        type: str | None = None,  # the wire name; defaults from the status
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.type = type or ERROR_TYPES.get(status, "server_error")
        self.headers = dict(headers) if headers is not None else _default_headers(status)

    def __reduce__(self) -> tuple[Any, ...]:
        # NOTE: Exception pickles as `cls(*self.args)`, and args is (message,) only: Ray
        # could not rebuild the error on the caller's side, which then saw a plain 500.
        return (_rebuild, (type(self), self.message, dict(self.__dict__)))

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "code": self.code,
                "param": self.param,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @property
    def should_retry(self) -> bool:
        return self.headers.get("x-should-retry") == "true"

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.code!r}, {self.message!r}, param={self.param!r})"


def _rebuild(cls: type[APIError], message: str, state: dict[str, Any]) -> APIError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


def api_error_in(exc: BaseException) -> APIError | None:
    """The APIError an exception is or carries: Ray re-raises a remote one as
    `RayTaskError(APIError)` (an instance of both, the original as `.cause`), possibly
    wrapped again at every hop; plain chaining (`raise ... from`) is followed too."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        cause = getattr(current, "cause", None)
        if isinstance(current, APIError):
            # A dual instance reads its fields from `.cause`; hand out the original.
            return cause if isinstance(cause, APIError) else current
        current = cause if isinstance(cause, BaseException) else current.__cause__
    return None


def echo(text: str) -> str:
    """Client text as it may appear in an error message: at most MAX_ECHO_CHARS."""
    if len(text) <= MAX_ECHO_CHARS:
        return text
    return text[:MAX_ECHO_CHARS] + f"... ({len(text)} characters)"


def _default_headers(status: int) -> dict[str, str]:
    # 4xx: the request itself is at fault, repeating it cannot help.
    return dict(NO_RETRY) if 400 <= status < 500 else {}


def _retry_after(retry_after_s: float) -> dict[str, str]:
    # NOTE: Retry-After is whole seconds; rounding 0.2 s down to 0 would invite a hot loop.
    seconds = max(1, math.ceil(retry_after_s)) if math.isfinite(retry_after_s) else 1
    return {"Retry-After": str(seconds), "x-should-retry": "true"}


# ------------------------------------------------------------------------------- 400


def invalid_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, "invalid_request", message, param=param)


def unknown_parameter(name: str) -> APIError:
    return APIError(400, "unknown_parameter", f"Unknown parameter: '{name}'.", param=name)


def unsupported_parameter(name: str, why: str) -> APIError:
    message = f"Unsupported parameter: '{name}': {why}"
    return APIError(400, "unsupported_parameter", message, param=name)


def invalid_grammar(reason: str, param: str | None) -> APIError:
    return APIError(400, "invalid_grammar", f"Invalid grammar: {reason}", param=param)


def request_limit_exceeded(limit: str, value: int, bound: int, param: str | None) -> APIError:
    """A request over one of the server's or the API key's size limits, naming the limit."""
    message = f"'{param}' is {value}; the limit {limit} allows at most {bound}."
    return APIError(400, "request_limit_exceeded", message, param=param)


def profile_mismatch(code: str, message: str, param: str) -> APIError:
    """A generation asks for a model or output format its profile does not offer."""
    return APIError(400, code, message, param=param)


def deadline_too_short(message: str, param: str | None = "timeout") -> APIError:
    return APIError(400, "deadline_too_short", message, param=param)


def context_length_exceeded(
    message: str, status: int = 400, param: str | None = "messages"
) -> APIError:
    _check_too_large_status(status)
    return APIError(status, "context_length_exceeded", message, param=param)


def max_tokens_exceeded(
    message: str, status: int = 400, param: str | None = "max_tokens"
) -> APIError:
    _check_too_large_status(status)
    return APIError(status, "max_tokens_exceeded", message, param=param)


def _check_too_large_status(status: int) -> None:
    # 400 on the OpenAI endpoints (what OpenAI clients expect), 422 on /v1/generations.
    if status not in (400, 422):
        raise ValueError(f"a too-large error is 400 or 422, not {status}")


# ------------------------------------------------------------------------- 401 - 413


# A 401 names the scheme it wants (RFC 9110), on the public and the admin port alike.
BEARER_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def invalid_api_key(message: str = "Invalid or missing API key.") -> APIError:
    return APIError(401, "invalid_api_key", message, headers={**NO_RETRY, **BEARER_CHALLENGE})


def permission_denied(code: str, message: str) -> APIError:
    return APIError(403, code, message)


def not_found(code: str, message: str, param: str | None = None) -> APIError:
    return APIError(404, code, message, param=param)


def route_not_found(path: str) -> APIError:
    return APIError(404, "not_found", f"No route {echo(path)!r} on this server.")


def method_not_allowed(method: str, path: str, allowed: list[str]) -> APIError:
    """405 with the `Allow` header listing the methods the route takes."""
    headers = {**NO_RETRY, "Allow": ", ".join(allowed)}
    message = f"{echo(method)} is not allowed on {echo(path)!r}; use {', '.join(allowed)}."
    return APIError(405, "method_not_allowed", message, headers=headers)


def conflict(code: str, message: str) -> APIError:
    return APIError(409, code, message)


def body_too_large(limit: int) -> APIError:
    return APIError(413, "body_too_large", f"Request body exceeds the limit of {limit} bytes.")


# ------------------------------------------------------------------------- 429 / 503


def limit_exceeded(code: str, message: str, retry_after_s: float) -> APIError:
    return APIError(429, code, message, headers=_retry_after(retry_after_s))


def overloaded(message: str, retry_after_s: float) -> APIError:
    return APIError(503, "overloaded", message, headers=_retry_after(retry_after_s))


def deadline_unmeetable(message: str, retry_after_s: float) -> APIError:
    return APIError(503, "deadline_unmeetable", message, headers=_retry_after(retry_after_s))


# ------------------------------------------------------------------------------- 500


def internal_error(message: str = "Internal error.", retryable: bool = False) -> APIError:
    # NOTE: only the caller knows whether a repeat is safe (nothing was sent, no side
    # effect recorded); default to "do not repeat", which never duplicates work.
    headers = {"x-should-retry": "true" if retryable else "false"}
    return APIError(500, "internal_error", message, headers=headers)


# ------------------------------------------------------------- Starlette apps


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


# ------------------------------------------------------------- /v1/server_info data

TAXONOMY: list[dict[str, Any]] = [
    {
        "class": "malformed_request",
        "status": [400],
        "type": ERROR_TYPES[400],
        "client_action": "fix the request",
        "should_retry": False,
        "codes": [
            "invalid_request",
            "unknown_parameter",
            "unsupported_parameter",
            "invalid_grammar",
            "model_not_allowed",
            "output_format_not_allowed",
        ],
    },
    {
        "class": "not_authenticated",
        "status": [401],
        "type": ERROR_TYPES[401],
        "client_action": "fix credentials",
        "should_retry": False,
        "codes": ["invalid_api_key"],
    },
    {
        "class": "not_permitted",
        "status": [403],
        "type": ERROR_TYPES[403],
        "client_action": "fix credentials",
        "should_retry": False,
        "codes": ["model_not_permitted", "profile_not_permitted", "admin_not_permitted"],
    },
    {
        "class": "not_found",
        "status": [404],
        "type": ERROR_TYPES[404],
        "client_action": "none: the resource does not exist for this caller",
        "should_retry": False,
        "codes": [
            "model_not_found",
            "generation_not_found",
            "conversation_not_found",
            "profile_not_found",
            "request_not_found",
        ],
    },
    {
        "class": "unknown_route",
        "status": [404],
        "type": ERROR_TYPES[404],
        "client_action": "fix the URL",
        "should_retry": False,
        "codes": ["not_found"],
    },
    {
        "class": "wrong_method",
        "status": [405],
        "type": ERROR_TYPES[405],
        "client_action": "use a method the Allow header lists",
        "should_retry": False,
        "codes": ["method_not_allowed"],
    },
    {
        "class": "conflict",
        "status": [409],
        "type": ERROR_TYPES[409],
        "client_action": "stop retrying this id",
        "should_retry": False,
        "codes": ["request_id_in_use", "idempotency_key_reused", "stale_revision"],
    },
    {
        "class": "too_large",
        "status": [413, 400, 422],
        "type": ERROR_TYPES[413],
        "client_action": "shrink the body, prompt or max_tokens",
        "should_retry": False,
        "codes": [
            "body_too_large",
            "context_length_exceeded",
            "max_tokens_exceeded",
            "request_limit_exceeded",
        ],
        "note": "body_too_large is 413; the others are 400 on OpenAI endpoints, "
        "422 on /v1/generations; the message names the limit that fired",
    },
    {
        "class": "limit_exceeded",
        "status": [429],
        "type": ERROR_TYPES[429],
        "client_action": "shed load; retry after Retry-After",
        "should_retry": True,
        "retry_after": True,
        "codes": ["concurrency_limit", "token_rate_limit"],
    },
    {
        "class": "capacity_unavailable",
        "status": [503],
        "type": ERROR_TYPES[503],
        "client_action": "retry elsewhere with backoff",
        "should_retry": True,
        "retry_after": True,
        "codes": ["overloaded", "deadline_unmeetable"],
    },
    {
        "class": "deadline_too_short",
        "status": [400],
        "type": ERROR_TYPES[400],
        "client_action": "raise the deadline",
        "should_retry": False,
        "codes": ["deadline_too_short"],
    },
    {
        "class": "internal",
        "status": [500],
        "type": ERROR_TYPES[500],
        "client_action": "retry only if the request is idempotent",
        "should_retry": "only when x-should-retry is true",
        "codes": ["internal_error"],
    },
]
