"""`GET /openapi.json` of the public port: every public route, from the models it parses with.

The document is built once per process (per ingress replica) and served as bytes. It names
what this server accepts where the models leave it open: the served model id, the generation
profiles and output formats (other values are a 404 or 400, which it also declares). On a
keyed server it needs a key like every route but `/health`: it reveals the route table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from serve_app.generations.protocol import (
    ConversationCreate,
    ConversationItemsCreate,
    ConversationUpdate,
    GenerationCreate,
)
from serve_app.openai.request_ids import MAX_ID_CHARS
from serve_app.openapi.document import (
    ErrorResponse,
    Operation,
    Param,
    Reply,
    Schema,
    Stream,
    build_document,
)
from serve_app.openapi.replies import (
    Conversation,
    ConversationDeleted,
    ConversationItem,
    ConversationItemList,
    Generation,
    Health,
    InputItemList,
    ModelList,
    OpenAPIDocument,
    OutputDelta,
    ResponseDeleted,
    ResponseEvent,
    ResponseObject,
    ServerInfo,
)
from serve_app.protocol import (
    IGNORED_PARAMETERS,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
)
from serve_app.resources.idempotency import MAX_IDEMPOTENCY_KEY_CHARS
from serve_app.resources.item_pages import DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT
from serve_app.responses.protocol import ResponseCreate

PATH = "/openapi.json"
TITLE = "serve-app"
VERSION = "1"
DESCRIPTION = (
    "OpenAI-compatible chat and completions, the Responses API, and task-style generation "
    "resources. Every "
    'error is {"error": {message, type, code, param}}; 4xx carry x-should-retry: false, '
    "429 and 503 carry Retry-After."
)

# Errors every admitted generation-style request can meet (the rest per route below).
ADMITTED = (400, 401, 403, 404, 409, 413, 429, 500, 503)


def _openai_stream(chunk: type) -> Stream:
    # A failure after the headers is an error frame, then [DONE].
    return Stream({"message": (chunk, ErrorResponse)}, done="[DONE]")


REQUEST_ID = Param(
    "X-Request-Id",
    "header",
    "One live attempt per id; a completed one replays its result. At most "
    f"{MAX_ID_CHARS} characters.",
    {"type": "string", "minLength": 1, "maxLength": MAX_ID_CHARS},
)
IDEMPOTENCY_KEY = Param(
    "Idempotency-Key",
    "header",
    "Same key, same body: the recorded generation; a different body: 409. "
    f"1 to {MAX_IDEMPOTENCY_KEY_CHARS} printable characters.",
    {"type": "string", "minLength": 1, "maxLength": MAX_IDEMPOTENCY_KEY_CHARS},
)
GENERATION_ID = Param("generation_id", "path", "A generation's id (`gen_...`).")
CONVERSATION_ID = Param("conversation_id", "path", "A conversation's id (`conv_...`).")
ITEM_ID = Param("item_id", "path", "An item's id (`msg_...`).")
LIST_PARAMS = (
    Param(
        "limit", "query", f"Items per page (default {DEFAULT_LIST_LIMIT}).",
        {"type": "integer", "minimum": 1, "maximum": MAX_LIST_LIMIT},
    ),
    Param(
        "order", "query", "`desc` (newest first, the default) or `asc`.",
        {"type": "string", "enum": ["asc", "desc"]},
    ),
    Param("after", "query", "An item id of this conversation: the page after it."),
)  # fmt: skip
EXPECTED_REVISION = Param(
    "expected_revision", "query",
    "Delete only at this revision (409 `stale_revision` otherwise).",
    {"type": "integer", "minimum": 0},
)  # fmt: skip
RESPONSE_ID = Param("response_id", "path", "A stored response's id (`resp_...`).")
RESPONSE_IDEMPOTENCY_KEY = Param(
    "Idempotency-Key",
    "header",
    "Same key, same body: the recorded response as JSON (never a new run or stream); a "
    f"different body: 409. Needs store: true. 1 to {MAX_IDEMPOTENCY_KEY_CHARS} printable "
    "characters.",
)
# Every typed event of a streamed response; the last is its terminal one.
RESPONSE_EVENTS = (
    "response.created", "response.queued", "response.in_progress", "response.output_item.added",
    "response.content_part.added", "response.output_text.delta", "response.output_text.done",
    "response.reasoning_text.delta", "response.reasoning_text.done",
    "response.content_part.done", "response.function_call_arguments.delta",
    "response.function_call_arguments.done", "response.output_item.done",
    "response.completed", "response.incomplete", "response.failed", "response.cancelled",
)  # fmt: skip
RESUME_PARAMS = (
    Param(
        "stream", "query",
        "`true`: the response's typed events (stored, then live) as server-sent events.",
        {"type": "string", "enum": ["true", "false"]},
    ),
    Param(
        "starting_after", "query",
        "With `stream=true`: the events after this `sequence_number` (all without it).",
        {"type": "integer", "minimum": -1},
    ),
)  # fmt: skip

OPERATIONS: list[Operation] = [
    Operation(
        "get", "/health", "health", "Green when an engine replica answers.", "service",
        {200: Reply("Ready.", Health)}, errors=(500, 503), is_open=True,
    ),
    Operation(
        "get", PATH, "openapi", "This document.", "service",
        {200: Reply("The OpenAPI 3.1 document.", OpenAPIDocument)}, errors=(500,),
    ),
    Operation(
        "get", "/v1/models", "list_models", "The models this key may use.", "openai",
        {200: Reply("The model list.", ModelList)}, errors=(500,),
    ),
    Operation(
        "get", "/v1/server_info", "server_info", "Identity, limits and policies.", "service",
        {200: Reply("What this deployment serves, enforces and promises.", ServerInfo)},
        errors=(500,),
    ),
    Operation(
        "post", "/v1/chat/completions", "create_chat_completion", "Chat completion.", "openai",
        {200: Reply(
            "The completion; with `stream: true`, chunks then `[DONE]`.",
            ChatCompletionResponse, stream=_openai_stream(ChatCompletionChunk),
        )},
        errors=ADMITTED, body=ChatCompletionRequest, params=(REQUEST_ID,),
    ),
    Operation(
        "post", "/v1/completions", "create_completion", "Text completion.", "openai",
        {200: Reply(
            "The completion; with `stream: true`, chunks then `[DONE]`.",
            CompletionResponse, stream=_openai_stream(CompletionChunk),
        )},
        errors=ADMITTED, body=CompletionRequest, params=(REQUEST_ID,),
    ),
    Operation(
        "post", "/v1/responses", "create_response", "Create a response.", "responses",
        {200: Reply(
            "The response; with `stream: true`, its typed events, the terminal one last.",
            ResponseObject,
            stream=Stream({name: (ResponseEvent,) for name in RESPONSE_EVENTS}),
        )},
        errors=ADMITTED, body=ResponseCreate, params=(RESPONSE_IDEMPOTENCY_KEY,),
    ),
    Operation(
        "get", "/v1/responses/{response_id}", "get_response",
        "A stored response; with `stream=true`, its events resumed after `starting_after`.",
        "responses",
        {200: Reply(
            "The response; with `stream=true`, its typed events after `starting_after`, "
            "then the live ones, the terminal one last.",
            ResponseObject,
            stream=Stream({name: (ResponseEvent,) for name in RESPONSE_EVENTS}),
        )},
        errors=(400, 404, 500), params=(RESPONSE_ID, *RESUME_PARAMS),
    ),
    Operation(
        "post", "/v1/responses/{response_id}/cancel", "cancel_response",
        "Cancel a stored response.", "responses",
        {200: Reply("The response (cancelled unless it had ended).", ResponseObject)},
        errors=(404, 500), params=(RESPONSE_ID,),
    ),
    Operation(
        "delete", "/v1/responses/{response_id}", "delete_response", "Delete a response.",
        "responses", {200: Reply("Deleted.", ResponseDeleted)}, errors=(404, 500),
        params=(RESPONSE_ID,),
    ),
    Operation(
        "get", "/v1/responses/{response_id}/input_items", "list_input_items",
        "A stored response's input items.", "responses",
        {200: Reply("The input items, newest first unless order=asc.", InputItemList)},
        errors=(400, 404, 500), params=(RESPONSE_ID,),
    ),
    Operation(
        "post", "/v1/generations", "create_generation", "Start a generation.", "generations",
        {
            200: Reply(
                "`sync`: the finished generation (also a replay); `stream`: its events.",
                Generation,
                stream=Stream({
                    "generation.created": (Generation,),
                    "output.delta": (OutputDelta,),
                    "generation.finished": (Generation,),
                }),
            ),
            202: Reply("`background`: the queued generation.", Generation, headers=("Location",)),
        },
        errors=(*ADMITTED, 422), body=GenerationCreate, params=(IDEMPOTENCY_KEY,),
    ),
    Operation(
        "get", "/v1/generations/{generation_id}", "get_generation", "A generation.",
        "generations", {200: Reply("The generation.", Generation)}, errors=(404, 500),
        params=(GENERATION_ID,),
    ),
    Operation(
        "post", "/v1/generations/{generation_id}/cancel", "cancel_generation",
        "Cancel a generation.", "generations",
        {200: Reply("The generation (cancelled unless it had ended).", Generation)},
        errors=(404, 500), params=(GENERATION_ID,),
    ),
    Operation(
        "post", "/v1/conversations", "create_conversation",
        "Start a conversation (OpenAI's Conversations API).", "conversations",
        {201: Reply("The conversation.", Conversation, headers=("Location",))},
        errors=(400, 413, 500, 503), body=ConversationCreate, body_required=False,
    ),
    Operation(
        "get", "/v1/conversations/{conversation_id}", "get_conversation", "A conversation.",
        "conversations", {200: Reply("The conversation.", Conversation)}, errors=(404, 500),
        params=(CONVERSATION_ID,),
    ),
    Operation(
        "post", "/v1/conversations/{conversation_id}", "update_conversation",
        "Replace a conversation's metadata.", "conversations",
        {200: Reply("The conversation (its revision unchanged).", Conversation)},
        errors=(400, 404, 413, 500), body=ConversationUpdate, params=(CONVERSATION_ID,),
    ),
    Operation(
        "delete", "/v1/conversations/{conversation_id}", "delete_conversation",
        "Delete a conversation.", "conversations",
        {200: Reply("Deleted.", ConversationDeleted)}, errors=(404, 500),
        params=(CONVERSATION_ID,),
    ),
    Operation(
        "get", "/v1/conversations/{conversation_id}/items", "list_conversation_items",
        "A conversation's items.", "conversations",
        {200: Reply("The items, newest first unless order=asc.", ConversationItemList)},
        errors=(400, 404, 500), params=(CONVERSATION_ID, *LIST_PARAMS),
    ),
    Operation(
        "post", "/v1/conversations/{conversation_id}/items", "create_conversation_items",
        "Append items (the revision goes up by one).", "conversations",
        {200: Reply("The items added.", ConversationItemList)},
        errors=(400, 404, 409, 413, 500, 503), body=ConversationItemsCreate,
        params=(CONVERSATION_ID,),
    ),
    Operation(
        "get", "/v1/conversations/{conversation_id}/items/{item_id}",
        "get_conversation_item", "One item of a conversation.", "conversations",
        {200: Reply("The item.", ConversationItem)}, errors=(404, 500),
        params=(CONVERSATION_ID, ITEM_ID),
    ),
    Operation(
        "delete", "/v1/conversations/{conversation_id}/items/{item_id}",
        "delete_conversation_item", "Delete an item (the revision goes up by one).",
        "conversations", {200: Reply("The conversation.", Conversation)},
        errors=(400, 404, 409, 500), params=(CONVERSATION_ID, ITEM_ID, EXPECTED_REVISION),
    ),
]  # fmt: skip


def public_document(
    *,
    model_ids: Sequence[str] = (),
    profiles: Sequence[str] = (),
    output_formats: Sequence[str] = (),
    keyed: bool = False,
) -> Schema:
    """The public document; the sequences name this server's accepted values (empty: any)."""
    doc = build_document(
        title=TITLE, version=VERSION, description=DESCRIPTION, operations=OPERATIONS, keyed=keyed
    )
    schemas = doc["components"]["schemas"]
    responses = schemas[ResponseCreate.__name__]["properties"]
    if model_ids:
        responses["model"] = _one_of(model_ids, "The served model (others: 404).")
    for name in (ChatCompletionRequest.__name__, CompletionRequest.__name__):
        properties = schemas[name]["properties"]
        if model_ids:
            properties["model"] = _one_of(model_ids, "The served model (others: 404).")
        for field in sorted(IGNORED_PARAMETERS):
            properties.setdefault(field, {"description": "Accepted and ignored."})
    generation = schemas[GenerationCreate.__name__]["properties"]
    if profiles:
        generation["profile"] = _one_of(profiles, "A profile of this server (others: 404).")
    if model_ids:
        generation["model"] = _nullable(_one_of(model_ids, "A model the profile offers."))
    if output_formats:
        generation["output_format"] = _nullable(
            _one_of(output_formats, "A format the profile offers (others: 400).")
        )
    return doc


def _one_of(values: Sequence[str], description: str) -> Schema:
    return {"type": "string", "enum": sorted(set(values)), "description": description}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}], "default": None}


def config_document(config: Any) -> Schema:
    """`public_document` for a ServeConfig."""
    options = config.generations
    formats = {"text", *options.output_formats}
    return public_document(
        model_ids=[config.model_id],
        profiles=[p.name for p in options.profiles],
        output_formats=sorted(formats),
        keyed=config.api_keys is not None,
    )


def openapi_route(config: Any) -> Route:
    """`GET /openapi.json`, its body built once."""
    import json

    body = json.dumps(config_document(config), separators=(",", ":")).encode()

    async def openapi(request: Request) -> Response:
        return Response(body, media_type="application/json")

    return Route(PATH, openapi, methods=["GET"])
