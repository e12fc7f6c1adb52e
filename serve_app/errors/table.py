"""The error table: the OpenAI-style `type` of each status, and the classes of errors
(status, what a client should do, whether to retry, the codes) that `/v1/server_info`
publishes and docs/contract.md shows."""

from __future__ import annotations

from typing import Any

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
            "response_not_found",
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
        "codes": ["internal_error", "engine_lost"],
        "note": "engine_lost: the engine replica or one of its workers failed under the "
        "request (an error frame once streaming)",
    },
]
