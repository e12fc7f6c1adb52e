"""`/v1/generations`: task-style generation resources over server-owned profiles.

Admission (authorization, profile rules, input assembly and budgets) completes before the
resource exists; then the runner owns the work (never the request: a disconnect does not
cancel a generation). sync -> 200 with the terminal resource; background -> 202 +
Location; stream -> SSE `generation.created`, `output.delta`..., `generation.finished`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serve_app import errors
from serve_app.access.keys import principal_of
from serve_app.config.options import ServeConfig
from serve_app.generations.admission import GenerationAdmission, conversation_not_found
from serve_app.generations.conversations import ConversationsAPI
from serve_app.generations.protocol import GenerationCreate, parse_body
from serve_app.protocol.event_stream import EventStreamResponse
from serve_app.resources.conversations import stale_revision
from serve_app.resources.idempotency import HEADER as IDEMPOTENCY_HEADER
from serve_app.resources.idempotency import REPLAYED_HEADER, idempotency_key, key_reused
from serve_app.resources.resource import resource_json
from serve_app.resources.runner import GenerationRunner
from serve_app.resources.running import Event, RunningGeneration
from serve_app.store import open_store
from serve_app.store.base import GenerationRecord, InsertOutcome, InsertResult

logger = logging.getLogger(__name__)


def sse_frame(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event; every event's JSON is compact, like the OpenAI stream's."""
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def sse_event(event: Event) -> bytes:
    name = "output.delta" if event.kind == "delta" else "generation.finished"
    return sse_frame(name, event.data)


class GenerationsAPI:
    def __init__(
        self,
        config: ServeConfig,
        tokenizer: Any,
        grammar: Any,
        engine: Any,
        identity: dict[str, Any],
        admit: Any = None,
    ) -> None:
        self.config = config
        self.options = config.generations
        self.identity = identity
        self.tokenizer = tokenizer
        self.admit = admit
        self.store = open_store(config.store, self.options.data_dir)
        owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.runner = GenerationRunner(
            self.store,
            engine.options(stream=True),
            grammar,
            self.options,
            owner,
            resource_json,
        )
        self.admission = GenerationAdmission(config, identity, tokenizer, self.store, owner)
        self.conversations = ConversationsAPI(self.store, self.options, admit)
        # Startup: resources a crashed process left queued/running become failed.
        self.runner.sweep_orphans()
        self._upkeep: asyncio.Task[None] | None = None
        with contextlib.suppress(RuntimeError):  # no loop yet: the first request starts it
            self.start_upkeep()

    def routes(self) -> list[Route]:
        conv = self.conversations
        return [
            Route("/v1/generations", self.create, methods=["POST"]),
            Route("/v1/generations/{generation_id}", self.get, methods=["GET"]),
            Route("/v1/generations/{generation_id}/cancel", self.cancel, methods=["POST"]),
            *conv.routes(),
        ]

    def start_upkeep(self) -> None:
        if self._upkeep is None or self._upkeep.done():
            # An empty context, as for the runs: no request's cancellation may reach it.
            self._upkeep = asyncio.get_running_loop().create_task(
                self.runner.upkeep_forever(), context=contextvars.Context()
            )

    # ------------------------------------------------------------------ endpoints

    async def create(self, request: Request) -> Response:
        self.start_upkeep()
        if self.admit is not None:
            await self.admit()
        body = await request.body()
        if len(body) > self.config.limits.max_body_bytes:
            raise errors.body_too_large(self.config.limits.max_body_bytes)
        req: GenerationCreate = parse_body(GenerationCreate, body)
        key = idempotency_key(request.headers.get(IDEMPOTENCY_HEADER))
        plan = await self.admission.admit(request, req, key)
        result, live = await self.runner.submit(plan, subscribe=req.execution == "stream")
        return await self._answer(req, result, live, request.scope.get("root_path", ""))

    async def get(self, request: Request) -> Response:
        self.start_upkeep()
        tenant = principal_of(request).tenant
        gid = request.path_params["generation_id"]
        record = await asyncio.to_thread(self.store.get_generation, tenant, gid)
        if record is None:
            raise not_found(gid)
        return JSONResponse(resource_json(record))

    async def cancel(self, request: Request) -> Response:
        self.start_upkeep()
        tenant = principal_of(request).tenant
        gid = request.path_params["generation_id"]
        record = await self.runner.cancel(tenant, gid)
        if record is None:
            raise not_found(gid)
        return JSONResponse(resource_json(record))

    # ------------------------------------------------------------------- response

    async def _answer(
        self, req: GenerationCreate, result: InsertResult, live: RunningGeneration, root: str
    ) -> Response:
        outcome = result.outcome
        if outcome is InsertOutcome.KEY_REUSED:
            raise key_reused()
        if outcome is InsertOutcome.CONVERSATION_NOT_FOUND:
            assert req.conversation is not None
            raise conversation_not_found(req.conversation.id)
        if outcome is InsertOutcome.STALE_REVISION:
            assert req.conversation is not None and result.conversation is not None
            raise stale_revision(result.conversation, req.conversation.expected_revision)
        if outcome is InsertOutcome.REPLAY:
            assert result.generation is not None
            return await self._replay(req, result.generation, root)
        record = live.plan.record
        location = {"Location": f"{root}/v1/generations/{record.id}"}
        if req.execution == "background":
            return JSONResponse(resource_json(record), status_code=202, headers=location)
        if req.execution == "stream":
            sub = live.subscribers[0]
            return EventStreamResponse(
                self._sse(live, sub, resource_json(record)),
                media_type="text/event-stream",
                headers={**location, "Cache-Control": "no-cache"},
            )
        final = await asyncio.shield(live.done)
        return JSONResponse(resource_json(final), headers=location)

    async def _replay(self, req: GenerationCreate, record: GenerationRecord, root: str) -> Response:
        """The same generation as JSON, never a new stream; a sync replay of a generation
        still running here waits for its end, as the original request would have."""
        live = self.runner.live.get(record.id)
        if req.execution == "sync" and live is not None:
            record = await asyncio.shield(live.done)
        location = f"{root}/v1/generations/{record.id}"
        headers = {"Location": location, REPLAYED_HEADER: "true"}
        status = 202 if req.execution == "background" and not record.is_terminal else 200
        return JSONResponse(resource_json(record), status_code=status, headers=headers)

    async def _sse(
        self, live: RunningGeneration, sub: Any, created: dict[str, Any]
    ) -> AsyncIterator[bytes]:
        try:
            yield sse_frame("generation.created", created)
            while True:
                event = await sub.queue.get()
                yield sse_event(event)
                if event.kind == "finished":
                    return
        finally:
            live.unsubscribe(sub)


def not_found(generation_id: str) -> errors.APIError:
    return errors.not_found(
        "generation_not_found", f"No generation '{errors.echo(generation_id)}'.", "generation_id"
    )
