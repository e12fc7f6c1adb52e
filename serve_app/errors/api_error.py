"""`APIError`: one error in the one JSON shape, with the retry headers its status calls for;
it crosses Ray whole, and `api_error_in` finds it inside Ray's wrappers."""

from __future__ import annotations

import math
from typing import Any

from starlette.responses import JSONResponse

from serve_app.errors.table import ERROR_TYPES

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
