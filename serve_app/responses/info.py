"""What `/v1/server_info` says of `/v1/responses`."""

from __future__ import annotations

from typing import Any

from serve_app.responses.protocol import (
    IGNORED_FIELDS,
    ITEM_MODELS,
    UNSUPPORTED_FIELDS,
    ResponseCreate,
)


def responses_info(retention_s: float) -> dict[str, Any]:
    """What `/v1/server_info` says of `/v1/responses`."""
    fields = sorted(name for name in ResponseCreate.model_fields)
    return {
        "routes": [
            "POST /v1/responses",
            "GET /v1/responses/{id}",
            "DELETE /v1/responses/{id}",
            "POST /v1/responses/{id}/cancel",
            "GET /v1/responses/{id}/input_items",
            "GET /v1/responses/{id}?stream=true&starting_after=N",
        ],
        "supported_fields": fields,
        "input_items": sorted(ITEM_MODELS),
        "tools": ["function"],
        "text_format": ["text", "json_object", "json_schema"],
        "truncation": "disabled only: an input over the context is 400 "
        "context_length_exceeded naming the budget; 'auto' is 400 unsupported_parameter",
        "reasoning": "the model's <think> span is a reasoning output item; effort and "
        "summary are 400 unsupported_parameter",
        "unsupported_fields": sorted(UNSUPPORTED_FIELDS),
        "ignored_fields": sorted(IGNORED_FIELDS),
        "store": "default true: kept for retention_s, then purged; store: false keeps "
        "nothing once the response is sent (it cannot be retrieved or chained: 404)",
        "retention_s": retention_s,
        "other_tenants_responses": "404 response_not_found, never revealed",
        "request_ids": "X-Request-Id is not a replay key here: a stored response is "
        "retrieved by its id",
        "background": "background: true answers 'queued' at once; poll GET, cancel with "
        "POST .../cancel (idempotent: a finished response stays as it ended); needs store",
        "resume": "GET /v1/responses/{id}?stream=true&starting_after=N replays the stored "
        "events after sequence number N, then follows the live ones, on any replica",
        "disconnect": "a stored response runs outside its request: a client that disconnects "
        "does not cancel it; store: false responses are cancelled with their request",
        "idempotency_key": "Idempotency-Key on POST (store: true) replays the recorded "
        "response as JSON, never a new run or stream; another body is 409",
        "conversation": "conversation (an id of /v1/conversations, or {id}) puts its items "
        "before the input; a completed or incomplete response appends its input and output "
        "items (one revision); 409 stale_revision while a generation holds the next turn; "
        "not with previous_response_id or store: false",
        "replicas": "any ingress replica reads, chains, cancels and resumes a stored response; "
        "x-served-by names the replica that answered",
    }
