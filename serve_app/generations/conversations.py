"""`/v1/conversations`: OpenAI's Conversations API (conversations with metadata, their message
items), scoped to the caller's tenant, with our revision rule as an extension.

Every change to a conversation's items bumps its `revision` by one. Appending or deleting
items may name `expected_revision` (409 `stale_revision` when it moved on), and is 409 while
a generation holds the next turn. A generation naming `conversation: {id, expected_revision}`
claims that turn atomically; when it completes, its input messages and the reply are appended
as items and the revision goes up by one; any other ending releases the turn unchanged.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serve_app import errors
from serve_app.access.keys import principal_of
from serve_app.config.profiles import GenerationOptions
from serve_app.generations.protocol import (
    ConversationCreate,
    ConversationItemsCreate,
    ConversationUpdate,
    parse_body,
)
from serve_app.resources.conversations import append_items, applied, item_not_found, not_found
from serve_app.resources.item_pages import item_list, item_page
from serve_app.store.base import ConversationRecord, EditOutcome, Store

PARAM = "conversation_id"
_BASE = "/v1/conversations/{conversation_id}"
# (method, path, handler of ConversationsAPI)
ROUTES = (
    ("POST", "/v1/conversations", "create"),
    ("GET", _BASE, "get"),
    ("POST", _BASE, "update"),
    ("DELETE", _BASE, "delete"),
    ("GET", _BASE + "/items", "list_items"),
    ("POST", _BASE + "/items", "create_items"),
    ("GET", _BASE + "/items/{item_id}", "get_item"),
    ("DELETE", _BASE + "/items/{item_id}", "delete_item"),
)


def conversation_json(record: ConversationRecord) -> dict[str, Any]:
    """OpenAI's conversation object; `revision`, `pending_generation` and `expires_at` are
    ours (the SDK keeps unknown fields)."""
    return {
        "id": record.id,
        "object": "conversation",
        "created_at": int(record.created_at),
        "metadata": record.metadata,
        "revision": record.revision,
        "pending_generation": record.pending_generation,
        "expires_at": record.expires_at,
    }


def conversations_info(retention_s: float) -> dict[str, Any]:
    """What `/v1/server_info` says of `/v1/conversations`."""
    return {
        "routes": [
            f"{route.methods and sorted(route.methods - {'HEAD'})[0]} {route.path}"
            for route in ConversationsAPI(None, None).routes()
        ],  # type: ignore[arg-type]
        "shape": "OpenAI's Conversations API; revision, pending_generation and expires_at "
        "are extensions",
        "items": "message items (user, assistant); a response appends its function calls, "
        "tool outputs and reasoning as items too",
        "revision": "every change to the items bumps revision; expected_revision on an item "
        "edit or a generation's turn is 409 stale_revision when it moved on",
        "used_by": {
            "/v1/generations": "conversation: {id, expected_revision}: claims the next turn",
            "/v1/responses": "conversation: id or {id}: appends when the response ends",
        },
        "retention_s": retention_s,
        "other_tenants_conversations": "404 conversation_not_found, never revealed",
    }


class ConversationsAPI:
    def __init__(self, store: Store, options: GenerationOptions, admit: Any = None) -> None:
        self.store = store
        self.options = options
        self.admit = admit

    def routes(self) -> list[Route]:
        return [
            Route(path, getattr(self, handler), methods=[method])
            for method, path, handler in ROUTES
        ]

    @property
    def expires_at(self) -> float:
        # Retention counts from a conversation's last change.
        return time.time() + self.options.retention_s

    # ---------------------------------------------------------------- conversations

    async def create(self, request: Request) -> Response:
        if self.admit is not None:
            await self.admit()
        req: ConversationCreate = parse_body(ConversationCreate, await request.body())
        now = time.time()
        record = ConversationRecord(
            id="conv_" + uuid.uuid4().hex,
            tenant=principal_of(request).tenant,
            revision=0,
            items=[item.stored() for item in req.items or ()],
            created_at=now,
            updated_at=now,
            expires_at=now + self.options.retention_s,
            metadata=req.metadata or {},
        )
        await asyncio.to_thread(self.store.create_conversation, record)
        root = request.scope.get("root_path", "")
        return JSONResponse(
            conversation_json(record),
            status_code=201,
            headers={"Location": f"{root}/v1/conversations/{record.id}"},
        )

    async def get(self, request: Request) -> Response:
        return JSONResponse(conversation_json(await self._record(request)))

    async def update(self, request: Request) -> Response:
        req: ConversationUpdate = parse_body(ConversationUpdate, await request.body())
        cid, tenant = self._ids(request)
        record = await asyncio.to_thread(
            self.store.update_conversation_metadata, tenant, cid, req.metadata or {},
            self.expires_at,
        )  # fmt: skip
        if record is None:
            raise not_found(cid, PARAM)
        return JSONResponse(conversation_json(record))

    async def delete(self, request: Request) -> Response:
        cid, tenant = self._ids(request)
        if not await asyncio.to_thread(self.store.delete_conversation, tenant, cid):
            raise not_found(cid, PARAM)
        return JSONResponse({"id": cid, "object": "conversation.deleted", "deleted": True})

    # ------------------------------------------------------------------------ items

    async def list_items(self, request: Request) -> Response:
        """Newest first unless `order=asc`, `limit` per page, paged by `after` (an item id)."""
        refuse_include(request)
        items = list((await self._record(request)).items)
        return JSONResponse(item_page(items, request.query_params, "item"))

    async def create_items(self, request: Request) -> Response:
        """Appends under the revision rule; answers the added items (OpenAI's list)."""
        refuse_include(request)
        if self.admit is not None:
            await self.admit()
        req: ConversationItemsCreate = parse_body(ConversationItemsCreate, await request.body())
        cid, tenant = self._ids(request)
        items = [item.stored() for item in req.items]
        await append_items(
            self.store, tenant, cid, items, expected_revision=req.expected_revision,
            retention_s=self.options.retention_s, param=PARAM,
        )  # fmt: skip
        return JSONResponse(item_list(items))

    async def get_item(self, request: Request) -> Response:
        refuse_include(request)
        item_id = request.path_params["item_id"]
        for item in (await self._record(request)).items:
            if item["id"] == item_id:
                return JSONResponse(item)
        raise item_not_found(item_id)

    async def delete_item(self, request: Request) -> Response:
        """Removes the item under the revision rule (`?expected_revision=N`); answers the
        conversation, as OpenAI's does."""
        cid, tenant = self._ids(request)
        item_id = request.path_params["item_id"]
        expected = expected_revision(request.query_params.get("expected_revision"))
        result = await asyncio.to_thread(
            self.store.delete_conversation_item, tenant, cid, item_id, expected, self.expires_at
        )
        if result.outcome is EditOutcome.ITEM_NOT_FOUND:
            raise item_not_found(item_id)
        return JSONResponse(conversation_json(applied(result, cid, expected, PARAM)))

    # ---------------------------------------------------------------------- helpers

    def _ids(self, request: Request) -> tuple[str, str]:
        return request.path_params["conversation_id"], principal_of(request).tenant

    async def _record(self, request: Request) -> ConversationRecord:
        cid, tenant = self._ids(request)
        record = await asyncio.to_thread(self.store.get_conversation, tenant, cid)
        if record is None:
            raise not_found(cid, PARAM)
        return record


def refuse_include(request: Request) -> None:
    """`include` asks for output data (logprobs, image urls) that is never stored here."""
    for name in ("include", "include[]"):
        if request.query_params.getlist(name):
            raise errors.unsupported_parameter(
                "include", "no additional item data (logprobs, image urls) is stored"
            )


def expected_revision(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        revision = int(value)
    except ValueError:
        revision = -1
    if revision < 0:
        raise errors.invalid_request(
            "'expected_revision' is a non-negative integer.", "expected_revision"
        )
    return revision
