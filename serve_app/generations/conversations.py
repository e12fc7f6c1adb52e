"""`/v1/conversations`: server-managed history, scoped to the caller's tenant.

A generation naming `conversation: {id, expected_revision}` claims the next turn atomically
(a stale revision, or a turn already in progress, is 409 `stale_revision`); when it
completes, its input messages and the reply are appended and the revision goes up by one.
A generation that does not complete releases the turn and changes nothing.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serve_app import errors
from serve_app.access.keys import principal_of
from serve_app.config.profiles import GenerationOptions
from serve_app.generations.protocol import ConversationCreate, parse_body
from serve_app.store.base import ConversationRecord, Store


def conversation_json(record: ConversationRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "object": "conversation",
        "revision": record.revision,
        "messages": record.messages,
        "pending_generation": record.pending_generation,
        "created_at": record.created_at,
        "updated_at": record.updated_at,
        "expires_at": record.expires_at,
    }


class ConversationsAPI:
    def __init__(self, store: Store, options: GenerationOptions, admit: Any = None) -> None:
        self.store = store
        self.options = options
        self.admit = admit

    async def create(self, request: Request) -> Response:
        if self.admit is not None:
            await self.admit()
        body = await request.body()
        req: ConversationCreate = parse_body(ConversationCreate, body)
        now = time.time()
        record = ConversationRecord(
            id="conv_" + uuid.uuid4().hex,
            tenant=principal_of(request).tenant,
            revision=0,
            messages=[m.model_dump() for m in req.messages],
            created_at=now,
            updated_at=now,
            expires_at=now + self.options.retention_s,
        )
        await asyncio.to_thread(self.store.create_conversation, record)
        return JSONResponse(
            conversation_json(record),
            status_code=201,
            headers={
                "Location": f"{request.scope.get('root_path', '')}/v1/conversations/{record.id}"
            },
        )

    async def get(self, request: Request) -> Response:
        cid = request.path_params["conversation_id"]
        tenant = principal_of(request).tenant
        record = await asyncio.to_thread(self.store.get_conversation, tenant, cid)
        if record is None:
            raise not_found(cid)
        return JSONResponse(conversation_json(record))

    async def delete(self, request: Request) -> Response:
        cid = request.path_params["conversation_id"]
        tenant = principal_of(request).tenant
        if not await asyncio.to_thread(self.store.delete_conversation, tenant, cid):
            raise not_found(cid)
        return JSONResponse({"id": cid, "object": "conversation.deleted", "deleted": True})


def not_found(conversation_id: str) -> errors.APIError:
    return errors.not_found(
        "conversation_not_found",
        f"No conversation '{errors.echo(conversation_id)}'.",
        "conversation_id",
    )
