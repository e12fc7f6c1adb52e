"""Who runs a stored response: the `responses` deployment, not the ingress replica that
accepted it.

A stored response outlives its HTTP request (a disconnect stops reading, never the work), so
it must outlive the ingress replica too: an ingress replica that dies, or is scaled down,
takes its requests with it, never the responses they started. `ResponseRunnerService` is a
CPU deployment of its own (placed as the ingress is: on the head of a cluster, where the
SQLite store lives) holding a `ResponseRunner`; every ingress replica starts, follows,
cancels and reads responses through `RunnerClient`. One runner replica (the default) keeps
every live response in one process, so any ingress follows it from memory; a runner that
dies leaves records that end `failed` / `engine_lost` when next read, as before.

An app built without the deployment (unit tests build the ingress alone) runs the same
service inside the ingress process.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from serve_app import errors
from serve_app.config.options import ServeConfig
from serve_app.responses.admission import AdmittedResponse
from serve_app.responses.event_channel import Batch, EventChannels, EventHub
from serve_app.responses.live import is_terminal
from serve_app.responses.objects import first_output, object_builder
from serve_app.responses.output import Event
from serve_app.responses.runner import ResponseRunner
from serve_app.store import open_store
from serve_app.store.base import ResponseRecord, Store
from serve_app.workers.constraint import compile_grammar


class ResponseRunnerService:
    def __init__(
        self,
        config: ServeConfig,
        engine_handle: Any,
        grammar_handle: Any,
        identity: dict[str, Any],
        store: Store | None = None,
    ) -> None:
        engine = engine_handle.options(stream=True)
        self.grammar = grammar_handle
        self.store = store or open_store(config.store, config.generations.data_dir)
        self.runner = ResponseRunner(
            self.store,
            engine,
            object_builder(identity),
            first_output,
            config.responses.retention_s,
            config.generations.orphan_after_s,
            config.generations.retention_s,
        )
        self.events = EventHub(self.runner.follow_live)

    async def start(self, admitted: AdmittedResponse) -> list[Event]:
        """Start the run; returns its events so far once it is recorded (background: at
        `queued`) or, in the foreground, once its first output came. An engine refusal
        before any output raises its API error, and nothing is stored."""
        if admitted.grammar_spec is not None:  # compiled here: this process owns it
            grammar = await compile_grammar(self.grammar, admitted.grammar_spec)
            request = dataclasses.replace(admitted.engine_request, grammar=grammar)
            admitted = dataclasses.replace(admitted, engine_request=request, grammar_spec=None)
        live = await self.runner.start(admitted)
        return list(live.events)

    async def result(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        """The response once it has ended (a caller that goes away stops waiting, never the
        run); None when there is no such response."""
        live = self.runner.find(tenant, response_id)
        if live is not None:
            await asyncio.wait([live.done])
            return live.done.result()
        final = None
        async for batch in self.runner.follow_batches(tenant, response_id, -1):
            final = batch[-1].get("response", final)
        return final

    async def follow(self, tenant: str, response_id: str, after: int) -> AsyncIterator[list[Event]]:
        """The events after sequence number `after` until the terminal one, in batches."""
        async for batch in self.runner.follow_batches(tenant, response_id, after):
            yield batch

    async def event_channel(self, channel_id: str) -> AsyncIterator[str | Batch]:
        """An ingress replica's event channel (`event_channel.py`)."""
        async for item in self.events.serve(channel_id):
            yield item

    async def subscribe(
        self, channel_id: str, sub_id: str, tenant: str, response_id: str, after: int
    ) -> bool:
        """Follow a response this replica runs into that channel; False when it cannot."""
        return self.events.subscribe(channel_id, sub_id, tenant, response_id, after)

    async def unsubscribe(self, channel_id: str, sub_id: str) -> None:
        self.events.unsubscribe(channel_id, sub_id)

    async def cancel(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        return await self.runner.cancel(tenant, response_id)

    async def record(self, tenant: str, response_id: str) -> ResponseRecord | None:
        return await self.runner.record(tenant, response_id)


class RunnerClient:
    """The ingress's side: calls on the runner deployment's handle, or on a service in this
    process. The runner's API errors arrive as themselves."""

    def __init__(self, handle: Any = None, local: ResponseRunnerService | None = None) -> None:
        assert (handle is None) != (local is None)
        self.handle = handle
        self.local = local
        self.channels = EventChannels(handle, is_terminal) if handle is not None else None

    async def _call(self, name: str, *args: Any) -> Any:
        if self.local is not None:
            return await getattr(self.local, name)(*args)
        try:
            return await getattr(self.handle, name).remote(*args)
        except Exception as exc:
            found = errors.api_error_in(exc)
            if found is None:
                raise
            raise found from None

    async def start(self, admitted: AdmittedResponse) -> list[Event]:
        return await self._call("start", admitted)

    async def result(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        return await self._call("result", tenant, response_id)

    async def cancel(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        return await self._call("cancel", tenant, response_id)

    async def record(self, tenant: str, response_id: str) -> ResponseRecord | None:
        return await self._call("record", tenant, response_id)

    async def follow(self, tenant: str, response_id: str, after: int) -> AsyncIterator[Event]:
        if self.local is not None:
            async for batch in self.local.follow(tenant, response_id, after):
                for event in batch:
                    yield event
            return
        assert self.channels is not None
        async with aclosing(self.channels.follow(tenant, response_id, after)) as events:
            async for event in events:  # a reader that leaves unsubscribes at once
                yield event
                if is_terminal(event):
                    return
                after = event["sequence_number"]
        # No channel (or it stopped carrying them): the rest through a call of its own.
        batches = self.handle.options(stream=True).follow.remote(tenant, response_id, after)
        try:
            async for batch in batches:
                for event in batch:
                    yield event
        finally:
            batches.cancel()  # a reader that left: the runner stops sending, the run goes on
