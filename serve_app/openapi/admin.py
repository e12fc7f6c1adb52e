"""`GET /openapi.json` of the admin port: the admin routes, their bodies, the admin key.

Like the admin routes themselves it needs the admin key (or an API key with the admin
permission) whenever one is configured.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from serve_app.openapi.document import Operation, Param, Reply, Schema, build_document

PATH = "/openapi.json"


class DrainRequest(BaseModel):
    """The body of `POST /admin/v1/drain` (none: drain)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    # False lifts the drain.
    draining: bool = True


class ReplicaTotals(BaseModel):
    model_config = ConfigDict(extra="allow")

    kv_blocks_total: int
    kv_blocks_used: int
    running: int
    waiting: int
    held: int
    live_requests: int


class AdminStats(BaseModel):
    """Every replica's last report and their totals."""

    model_config = ConfigDict(extra="allow")

    replicas: list[dict[str, Any]]
    total: ReplicaTotals
    draining: bool


class RequestTimeline(BaseModel):
    model_config = ConfigDict(extra="allow")

    request_id: str
    # One entry per engine request (prompt, attempt), from every replica.
    engine_requests: list[dict[str, Any]]


class AdminDocument(BaseModel):
    model_config = ConfigDict(extra="allow")

    openapi: str
    paths: dict[str, Any]


OPERATIONS: list[Operation] = [
    Operation(
        "get", "/admin/v1/stats", "admin_stats", "Per-replica and total engine stats.",
        "admin", {200: Reply("The stats.", AdminStats)}, errors=(403, 500),
    ),
    Operation(
        "get", "/admin/v1/requests/{request_id}", "admin_request_timeline",
        "The engine timelines of a recent request.", "admin",
        {200: Reply("The timelines.", RequestTimeline)}, errors=(403, 404, 500),
        params=(Param("request_id", "path", "An X-Request-Id or engine request id."),),
    ),
    Operation(
        "post", "/admin/v1/drain", "admin_drain",
        "Stop admitting new requests (in-flight ones finish); `draining: false` lifts it.",
        "admin", {200: Reply("The stats after the change.", AdminStats)},
        errors=(400, 403, 500), body=DrainRequest, body_required=False,
    ),
    Operation(
        "get", PATH, "admin_openapi", "This document.", "admin",
        {200: Reply("The OpenAPI 3.1 document of the admin port.", AdminDocument)},
        errors=(403, 500),
    ),
]  # fmt: skip


def admin_document(*, keyed: bool) -> Schema:
    """`keyed`: an admin key or API keys are configured (otherwise the port is open)."""
    return build_document(
        title="serve-app admin",
        version="1",
        description="The admin port: loopback by default, its own key, never on the public port.",
        operations=OPERATIONS,
        keyed=keyed,
    )


def admin_openapi_endpoint(keyed: bool, authorize: Callable[[Any], None]) -> Callable[..., Any]:
    """The admin app's handler for `PATH`, its body built once."""
    from starlette.responses import Response

    body = json.dumps(admin_document(keyed=keyed), separators=(",", ":")).encode()

    async def openapi(request: Any) -> Response:
        authorize(request)
        return Response(body, media_type="application/json")

    return openapi
