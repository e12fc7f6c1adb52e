"""One constructor per error code a route raises, grouped by status (the classes of
`serve_app.errors.table`): each fixes the status, the code and the retry headers."""

from __future__ import annotations

from serve_app.errors.api_error import NO_RETRY, APIError, _retry_after, echo

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


def engine_lost(message: str, retryable: bool = False) -> APIError:
    """The engine replica (or a worker of it) failed under a running request."""
    headers = {"x-should-retry": "true" if retryable else "false"}
    return APIError(500, "engine_lost", message, headers=headers)


# ------------------------------------------------------------------- engine refusals


def engine_refusal(
    code: str | None,
    message: str,
    *,
    grammar_param: str | None,
    deadline_param: str,
    retryable: bool,
) -> APIError:
    """The API error an engine output's error stands for, by its code (the error table's
    class): a grammar's own is the client's 400 naming `grammar_param`, a deadline the client
    set is named by where it was set, a lost engine is `engine_lost`, anything else 500.
    `retryable`: nothing of the answer was sent yet, so a repeat is safe."""
    if code == "invalid_grammar":
        return invalid_grammar(message, grammar_param)
    if code == "overloaded":  # the grammar compilers are saturated
        return overloaded(message, 1.0)
    if code == "request_limit_exceeded":
        return APIError(400, code, f"Invalid grammar: {message}", param=grammar_param)
    if code == "deadline_too_short":
        return deadline_too_short(message, deadline_param)
    if code == "deadline_unmeetable":
        return deadline_unmeetable(message, retry_after_s=1.0)
    if code == "engine_lost":
        return engine_lost(f"The engine failed: {message}", retryable=retryable)
    return internal_error(f"The engine failed: {message}", retryable=retryable)
