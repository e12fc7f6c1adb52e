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
|        |                         |                               | response_not_found,          |
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
| 500    | server_error            | retry only if idempotent      | internal_error,              |
|        |                         |                               | engine_lost                  |
| 503    | overloaded_error        | back off, retry elsewhere     | overloaded,                  |
|        |                         |                               | deadline_unmeetable          |

Retry headers: the official `openai` client retries 408/409/429/5xx on its own unless told
`x-should-retry: false`. So every 4xx and every non-repeatable 500 says `false`; 429 and 503
say `true` and carry `Retry-After` (whole seconds, at least 1). A 401 names its scheme in
`WWW-Authenticate: Bearer`.

The package: `table` (types and classes), `api_error` (`APIError`), `constructors` (one per
code), `handlers` (Starlette). Callers use `from serve_app import errors; errors.NAME`.

An APIError crosses Ray (a deployment or actor raising it to its caller) whole: it pickles
with every field, and `api_error_in` finds it inside Ray's wrappers.
"""

from __future__ import annotations

from serve_app.errors.api_error import (  # noqa: F401
    MAX_ECHO_CHARS,
    NO_RETRY,
    APIError,
    api_error_in,
    echo,
)
from serve_app.errors.constructors import (  # noqa: F401
    BEARER_CHALLENGE,
    body_too_large,
    conflict,
    context_length_exceeded,
    deadline_too_short,
    deadline_unmeetable,
    engine_lost,
    engine_refusal,
    internal_error,
    invalid_api_key,
    invalid_grammar,
    invalid_request,
    limit_exceeded,
    max_tokens_exceeded,
    method_not_allowed,
    not_found,
    overloaded,
    permission_denied,
    profile_mismatch,
    request_limit_exceeded,
    route_not_found,
    unknown_parameter,
    unsupported_parameter,
)
from serve_app.errors.handlers import (  # noqa: F401
    OnError,
    exception_handlers,
    of_exception,
)
from serve_app.errors.table import (  # noqa: F401
    ERROR_TYPES,
    TAXONOMY,
)
