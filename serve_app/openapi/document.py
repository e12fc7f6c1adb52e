"""An OpenAPI 3.1 document from a table of operations whose bodies are pydantic models.

The schemas are pydantic's own JSON Schemas of the models the routes parse and answer with
(`models_json_schema`, validation mode, refs under `#/components/schemas`), so the published
contract cannot drift from the parser: there is no hand-written copy of a request body.
Every error status an operation declares answers with the one error shape, `ErrorResponse`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from serve_app import errors

OPENAPI_VERSION = "3.1.0"
REF_TEMPLATE = "#/components/schemas/{model}"
BEARER = "bearer"

Schema = dict[str, Any]


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: str
    # The OpenAI-style class of the status (serve_app.errors.ERROR_TYPES).
    type: str
    # The exact cause, e.g. `invalid_request`, `model_not_found`, `overloaded`.
    code: str
    # The request field to fix, when one is at fault.
    param: str | None


class ErrorResponse(BaseModel):
    """The one error body of every route: `{"error": {message, type, code, param}}`."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorDetail


def ref(model: type[BaseModel]) -> Schema:
    return {"$ref": REF_TEMPLATE.format(model=model.__name__)}


@dataclass(frozen=True)
class Stream:
    """A `text/event-stream` answer: each event's `data` is the JSON of one of the models its
    event name lists, or `done` (a last data line that is not JSON, OpenAI's `[DONE]`)."""

    events: dict[str, tuple[type[BaseModel], ...]]
    done: str | None = None

    def models(self) -> list[type[BaseModel]]:
        return [m for models in self.events.values() for m in models]

    def event_schema(self) -> Schema:
        """One event as schemathesis and OpenAPI 3.1 read it: `{event, data, id?}`."""
        options: list[Schema] = [
            _event(name, {"anyOf": [ref(m) for m in models]})
            for name, models in self.events.items()
        ]
        if self.done is not None:
            names = sorted(self.events)
            options.append(_event_named(names, {"const": self.done}))
        return {"anyOf": options} if len(options) > 1 else options[0]


def _event(name: str, payload: Schema) -> Schema:
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}
    return _event_named([name], data)


def _event_named(names: list[str], data: Schema) -> Schema:
    return {
        "type": "object",
        "required": ["event", "data"],
        "properties": {"event": {"enum": names}, "data": data},
    }


@dataclass(frozen=True)
class Reply:
    """One success status: a JSON body (a model, or a schema where no model exists) and, for
    a request that asked to stream, server-sent events."""

    description: str
    model: type[BaseModel] | None = None
    schema: Schema | None = None
    stream: Stream | None = None
    headers: tuple[str, ...] = ()

    def models(self) -> list[type[BaseModel]]:
        found = [self.model] if self.model is not None else []
        return found + (self.stream.models() if self.stream is not None else [])


@dataclass(frozen=True)
class Param:
    name: str
    where: Literal["path", "header", "query"]
    description: str
    schema: Schema = field(default_factory=lambda: {"type": "string"})

    def to_json(self) -> Schema:
        required = self.where == "path"
        return {
            "name": self.name,
            "in": self.where,
            "required": required,
            "description": self.description,
            "schema": self.schema,
        }


@dataclass(frozen=True)
class Operation:
    method: Literal["get", "post", "delete"]
    path: str
    operation_id: str
    summary: str
    tag: str
    replies: dict[int, Reply]
    # Error statuses the route can answer (all in the one error shape).
    errors: tuple[int, ...] = ()
    body: type[BaseModel] | None = None
    # False: an empty body is the model's defaults.
    body_required: bool = True
    params: tuple[Param, ...] = ()
    # Reachable without a key on a keyed server (a load balancer's probe).
    is_open: bool = False

    def models(self) -> list[type[BaseModel]]:
        found = [self.body] if self.body is not None else []
        return found + [m for reply in self.replies.values() for m in reply.models()]


# Statuses whose errors only a keyed server gives (a key's permissions and budgets).
KEYED_ONLY = frozenset({401, 403, 429})

ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "Malformed request: fix it (the `param` names the field).",
    401: "Missing or invalid API key.",
    403: "The key may not use this model, profile or route.",
    404: "No such model or resource (other tenants' resources included).",
    409: "Conflict: this request id or key is in use, or a stale revision. Stop retrying.",
    413: "The body is over the size limit.",
    422: "Too large for the profile's budgets (context or output tokens).",
    429: "A limit of the key is exceeded: retry after Retry-After.",
    500: "Internal error: retry only when `x-should-retry` is true.",
    503: "Capacity unavailable (overloaded, draining, deadline unmeetable): back off.",
}


def error_reply(status: int) -> Schema:
    """The error shape with the retry headers the official clients obey."""
    if status in (429, 503):
        headers = {
            "Retry-After": _header(
                "Whole seconds to wait.", {"type": "string", "pattern": "^[0-9]+$"}
            ),
            "x-should-retry": _header("Always true.", {"type": "string", "enum": ["true"]}),
        }
    elif status >= 500:
        headers = {"x-should-retry": _header("Whether a repeat is safe.", _retry_flag())}
    else:
        headers = {
            "x-should-retry": _header(
                "Always false: repeating the request cannot help.",
                {"type": "string", "enum": ["false"]},
            )
        }
    return {
        "description": ERROR_DESCRIPTIONS.get(status, "Error."),
        "headers": headers,
        "content": {"application/json": {"schema": ref(ErrorResponse)}},
    }


def _retry_flag() -> Schema:
    return {"type": "string", "enum": ["true", "false"]}


def _header(description: str, schema: Schema) -> Schema:
    return {"description": description, "required": True, "schema": schema}


def reply_json(reply: Reply) -> Schema:
    content: Schema = {}
    body = ref(reply.model) if reply.model is not None else reply.schema
    if body is not None:
        content["application/json"] = {"schema": body}
    if reply.stream is not None:
        content["text/event-stream"] = {"schema": reply.stream.event_schema()}
    out: Schema = {"description": reply.description}
    if content:
        out["content"] = content
    if reply.headers:
        out["headers"] = {
            name: {"description": name, "required": True, "schema": {"type": "string"}}
            for name in reply.headers
        }
    return out


def operation_json(op: Operation, keyed: bool) -> Schema:
    responses: Schema = {str(status): reply_json(r) for status, r in sorted(op.replies.items())}
    for status in sorted(op.errors):
        if keyed or status not in KEYED_ONLY:
            responses[str(status)] = error_reply(status)
    if keyed and not op.is_open:
        responses.setdefault("401", error_reply(401))
    out: Schema = {
        "operationId": op.operation_id,
        "summary": op.summary,
        "tags": [op.tag],
        "responses": dict(sorted(responses.items())),
    }
    if op.params:
        out["parameters"] = [p.to_json() for p in op.params]
    if op.body is not None:
        out["requestBody"] = {
            "required": op.body_required,
            "content": {"application/json": {"schema": ref(op.body)}},
        }
    if keyed and op.is_open:
        out["security"] = []
    return out


@cache
def component_schemas(models: tuple[type[BaseModel], ...]) -> Schema:
    """pydantic's JSON Schemas of `models` and everything they reference (computed once)."""
    _, top = models_json_schema([(m, "validation") for m in models], ref_template=REF_TEMPLATE)
    return top.get("$defs", {})


def build_document(
    *,
    title: str,
    version: str,
    description: str,
    operations: list[Operation],
    keyed: bool,
) -> Schema:
    """The document; `keyed`: the server checks bearer keys (security scheme, 401s)."""
    models: dict[str, type[BaseModel]] = {ErrorResponse.__name__: ErrorResponse}
    for op in operations:
        for model in op.models():
            models.setdefault(model.__name__, model)
    paths: Schema = {}
    for op in operations:
        paths.setdefault(op.path, {})[op.method] = operation_json(op, keyed)
    schemas = component_schemas(tuple(models.values()))
    # A copy per document: callers refine it (server-specific enums) without touching the cache.
    components: Schema = {"schemas": copy.deepcopy(dict(sorted(schemas.items())))}
    components["schemas"]["ErrorDetail"]["properties"]["type"]["enum"] = error_types()
    doc: Schema = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "version": version, "description": description},
        "paths": paths,
        "components": components,
    }
    if keyed:
        components["securitySchemes"] = {
            BEARER: {"type": "http", "scheme": "bearer", "description": "An API key."}
        }
        doc["security"] = [{BEARER: []}]
    return doc


def error_types() -> list[str]:
    """Every `type` an error body can carry."""
    return sorted(set(errors.ERROR_TYPES.values()))
