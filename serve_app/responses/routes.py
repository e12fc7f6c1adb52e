"""`/v1/responses`: the OpenAI Responses API on the shared store.

Admission (auth, limits, chain, template, context budget, grammar) completes before any
header is sent; the first engine output decides the status code. Then the run's typed events
go out as SSE (`stream: true`) or are folded into one JSON response. A stored response
(`store`, the default) is written before its terminal event is sent and is kept for
`responses.retention_s`; every read and delete is scoped to the caller's tenant.

A stored response runs outside its request (`serve_app.responses.runner`): a client that
disconnects stops reading, never the work; `background: true` answers `queued` at once; any
replica polls, cancels, or resumes its event stream from the store (`?stream=true&
starting_after=N`). A `store: false` response runs inside its request, as a chat completion
does: a client that disconnects cancels it, and nothing is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from actors.outputs import RequestOutput
from serve_app import errors
from serve_app.access.keys import principal_of
from serve_app.config.options import ServeConfig
from serve_app.protocol.event_stream import EventStreamResponse
from serve_app.resources.idempotency import HEADER as IDEMPOTENCY_HEADER
from serve_app.resources.idempotency import REPLAYED_HEADER, idempotency_key, key_reused
from serve_app.resources.item_pages import item_page
from serve_app.responses.admission import AdmittedResponse, ResponseAdmission, response_not_found
from serve_app.responses.objects import first_output, object_builder
from serve_app.responses.output import EventNumbers, context_messages
from serve_app.responses.protocol import parse_body
from serve_app.responses.run import ResponseRun
from serve_app.responses.service import ResponseRunnerService, RunnerClient
from serve_app.store import open_store
from serve_app.store.base import ResponseRecord

logger = logging.getLogger(__name__)


def sse(event: dict[str, Any]) -> bytes:
    """One typed event, named as its `type` (as OpenAI sends them)."""
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class ResponsesAPI:
    def __init__(
        self,
        config: ServeConfig,
        tokenizer: Any,
        grammar: Any,
        engine: Any,
        identity: dict[str, Any],
        admit: Any = None,
        store: Any = None,
        runner: Any = None,
    ) -> None:
        self.config = config
        self.options = config.responses
        self.identity = identity
        self.admit = admit
        self.engine = engine.options(stream=True)  # store: false responses run here
        # One store per process: a second SQLite connection on the same file in this process
        # hid rows other processes committed from the first one's reads.
        self.store = store or open_store(config.store, config.generations.data_dir)
        self.admission = ResponseAdmission(config, identity, tokenizer, grammar, self.store)
        self.object_of = object_builder(identity)
        # Stored responses run in the runner deployment (`runner`, its handle), so they
        # outlive this replica; without one (an ingress built alone), in this process.
        if runner is None:
            local = ResponseRunnerService(config, engine, grammar, identity, store=self.store)
            self.runner = RunnerClient(local=local)
        else:
            self.runner = RunnerClient(handle=runner)
        self._upkeep: asyncio.Task[None] | None = None
        with contextlib.suppress(RuntimeError):  # no loop yet: the first request starts it
            self.start_upkeep()

    def routes(self) -> list[Route]:
        return [
            Route("/v1/responses", self.create, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.get, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"]),
            Route("/v1/responses/{response_id}/input_items", self.input_items, methods=["GET"]),
        ]

    def start_upkeep(self) -> None:
        if self._upkeep is None or self._upkeep.done():
            # An empty context: no request's cancellation may reach it.
            self._upkeep = asyncio.get_running_loop().create_task(
                self._purge_forever(), context=contextvars.Context()
            )

    async def _purge_forever(self) -> None:
        """Expired responses read as absent at once; their rows go every purge interval."""
        while True:
            try:
                await asyncio.to_thread(self.store.purge_expired)
            except Exception:
                logger.exception("response store purge failed")
            await asyncio.sleep(self.options.purge_interval_s)

    # ------------------------------------------------------------------ endpoints

    async def create(self, request: Request) -> Response:
        self.start_upkeep()
        if self.admit is not None:
            await self.admit()
        body = await request.body()
        if len(body) > self.config.limits.max_body_bytes:
            raise errors.body_too_large(self.config.limits.max_body_bytes)
        req = parse_body(body)
        key = idempotency_key(request.headers.get(IDEMPOTENCY_HEADER))
        if key is not None:
            return await self._create_once(request, body, key)
        admitted = await self.admission.admit(request, req)
        if req.store:
            return await self._run_stored(admitted)
        gen = self.engine.generate.remote(admitted.engine_request)
        try:
            first = await first_output(gen)
        except BaseException:
            gen.cancel()
            raise
        run = ResponseRun(admitted, self.object_of(admitted), self._save)
        if req.stream:
            return EventStreamResponse(
                self._sse(run, first, gen),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            async for _ in run.events(first, aiter_of(gen)):
                pass
        finally:
            gen.cancel()
        assert run.final is not None
        return JSONResponse(run.final)

    async def get(self, request: Request) -> Response:
        """The stored response; with `stream=true` its events after `starting_after` (all
        of them without), then the live ones until its terminal event."""
        record = await self._record(request)
        if request.query_params.get("stream") not in ("true", "1"):
            return JSONResponse(record.data["response"])
        after = _starting_after(request.query_params.get("starting_after"))
        events = self.runner.follow(record.tenant, record.id, after)
        return EventStreamResponse(
            (sse(event) async for event in events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )

    async def cancel(self, request: Request) -> Response:
        """Idempotent: the response after the cancel; one that had ended stays as it ended."""
        tenant = principal_of(request).tenant
        rid = request.path_params["response_id"]
        final = await self.runner.cancel(tenant, rid)
        if final is None:
            raise response_not_found(rid, "response_id")
        return JSONResponse(final)

    async def delete(self, request: Request) -> Response:
        tenant = principal_of(request).tenant
        rid = request.path_params["response_id"]
        if not await asyncio.to_thread(self.store.delete_response, tenant, rid):
            raise response_not_found(rid, "response_id")
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        """The response's input items, newest first unless `order=asc`, paged by `after`."""
        record = await self._record(request)
        page = item_page(record.data["input_items"], request.query_params, "input item")
        return JSONResponse(page)

    # -------------------------------------------------------------------- helpers

    async def _create_once(self, request: Request, body: bytes, key: str) -> Response:
        """With an Idempotency-Key: the response's id is the tenant's key's, so a repeat
        finds the first one (while it is kept) and gets its JSON, never a new run or stream;
        the same key with another body is 409."""
        req = parse_body(body)
        if not req.store:
            raise errors.invalid_request(
                f"{IDEMPOTENCY_HEADER} needs a stored response (store: true): a repeat replays "
                "it by its id.",
                IDEMPOTENCY_HEADER,
            )
        tenant = principal_of(request).tenant
        body_hash = hashlib.sha256(json.dumps(json.loads(body), sort_keys=True).encode()).digest()
        rid = keyed_response_id(tenant, key)
        found = await self.runner.record(tenant, rid)
        if found is not None:
            return _replayed(found, body_hash.hex())
        admitted = await self.admission.admit(request, req)
        admitted.response_id = rid
        admitted.engine_request = dataclasses.replace(admitted.engine_request, request_id=rid)
        admitted.idempotency = body_hash.hex()
        try:
            return await self._run_stored(admitted)
        except errors.APIError:
            raise
        except Exception:
            found = await self.runner.record(tenant, rid)  # a concurrent repeat inserted first
            if found is None:
                raise
            return _replayed(found, body_hash.hex())

    async def _run_stored(self, admitted: AdmittedResponse) -> Response:
        """A stored response: the runner owns it; this request only reads it."""
        events = await self.runner.start(admitted)
        rid = admitted.response_id
        if admitted.req.stream:
            return EventStreamResponse(
                (sse(event) async for event in self.runner.follow(admitted.tenant, rid, -1)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        if admitted.req.background:
            return JSONResponse(events[-1]["response"])
        # A disconnect cancels this wait (here and in the runner), never the run.
        final = await self.runner.result(admitted.tenant, rid)
        if final is None:
            raise response_not_found(rid)  # deleted while it ran
        return JSONResponse(final)

    async def _record(self, request: Request) -> ResponseRecord:
        tenant = principal_of(request).tenant
        rid = request.path_params["response_id"]
        record = await self.runner.record(tenant, rid)
        if record is None:
            raise response_not_found(rid, "response_id")
        return record

    async def _sse(self, run: ResponseRun, first: RequestOutput, gen: Any) -> AsyncIterator[bytes]:
        numbers = EventNumbers()
        try:
            async for event in run.events(first, aiter_of(gen)):
                yield sse(numbers.number(event))
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("response stream failed after headers")
            error = {"code": "internal_error", "message": "The stream failed."}
            final = self.object_of(run.admitted)(
                "failed", run.items.items, run.usage(), error=error
            )
            yield sse(numbers.number({"type": "response.failed", "response": final}))
        finally:
            gen.cancel()

    async def _save(self, admitted: AdmittedResponse, final: dict[str, Any]) -> None:
        if not admitted.req.store:
            return  # store: false keeps nothing once the response is sent
        record = ResponseRecord(
            admitted.response_id,
            admitted.tenant,
            final["status"],
            {
                "response": final,
                "input_items": admitted.input_items,
                "context": admitted.context + context_messages(final["output"]),
            },
            admitted.created_at,
            time.time() + self.options.retention_s,
        )
        await asyncio.to_thread(self.store.insert_response, record)


async def aiter_of(gen: Any) -> AsyncIterator[Any]:
    async for out in gen:
        yield out


def keyed_response_id(tenant: str, key: str) -> str:
    """The id a tenant's Idempotency-Key names (another tenant's same key: another id)."""
    return "resp_" + hashlib.sha256(f"{tenant}\0{key}".encode()).hexdigest()[:32]


def _replayed(record: ResponseRecord, body_hash: str) -> Response:
    if record.data.get("idempotency") != body_hash:
        raise key_reused()
    return JSONResponse(record.data["response"], headers={REPLAYED_HEADER: "true"})


def _starting_after(value: str | None) -> int:
    if value is None:
        return -1
    try:
        after = int(value)
    except ValueError:
        raise errors.invalid_request(
            "'starting_after' is an event's sequence_number.", "starting_after"
        ) from None
    if after < -1:
        raise errors.invalid_request("'starting_after' is -1 or more.", "starting_after")
    return after
