"""Stored responses run outside the HTTP request that created them, and their events are kept.

A stored response (`store: true`, the default) is a task this process owns
(`serve_app.resources.owned`, as generation resources are run): a client that disconnects
stops reading, never the work. Its typed events are numbered once, here, and kept in two
places: in memory for the readers in this process, and in the store for everyone else
(another ingress replica, a later resume, a restart). The store is written in batches
(`FLUSH_EVENTS` events or `FLUSH_PERIOD_S`, whichever comes first, and a heartbeat while the
engine is silent), never once per token: each write rewrites the record (the response so far)
and appends only the events new since the last one, in one transaction; the terminal event
is written, with the final record, before it is sent.

Cancel is a compare-and-set on the record's status: a cancel this process receives stops its
engine stream at once; one another replica wrote is seen by the owner at its next write,
whose compare-and-set fails. A record whose owner stopped writing for `orphan_after_s`
(the process running it is gone) is ended `failed` / `engine_lost` by whoever reads it next:
nothing is ever re-run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from actors.outputs import RequestOutput
from serve_app import errors
from serve_app.resources.conversations import append_items
from serve_app.resources.owned import OwnedTasks
from serve_app.responses.admission import AdmittedResponse
from serve_app.responses.live import LiveResponse, follow_live_events, is_terminal, until_terminal
from serve_app.responses.output import Event, context_messages, usage
from serve_app.responses.run import ResponseRun
from serve_app.store.base import ResponseRecord, Store
from serve_app.workers.merged_outputs import Merged, merged_outputs
from serve_app.workers.output_channel import EngineChannels

logger = logging.getLogger(__name__)

# The statuses the owner writes while it runs; a cancel from another replica moves the record
# to `cancelling` (the owner's next write then fails and it stops), then the owner ends it.
RUNNING = ("queued", "in_progress")
UNFINISHED = (*RUNNING, "cancelling")
# A record write carries at least this many new events, or is this old (batching).
FLUSH_EVENTS = 64
FLUSH_PERIOD_S = 0.5
# While no event comes (queued, a long prefill) the owner still writes this often: its
# heartbeat, and the moment it learns of a cancel another replica wrote.
HEARTBEAT_PERIOD_S = 2.0
# How often a reader in another process looks at the record for new events.
FOLLOW_POLL_S = 0.2
# A cancel sent to another replica than the owner ends the record itself once the owner has
# not written for this long (the owner is gone).
CANCEL_WAIT_S = 3 * HEARTBEAT_PERIOD_S

BaseOf = Callable[[AdmittedResponse], Callable[..., dict[str, Any]]]
# (gen, read): the engine call's first output (taken by `read`), or the API error it stands for.
FirstOutput = Callable[[Any, Awaitable[RequestOutput]], Awaitable[RequestOutput]]


class ResponseRunner:
    def __init__(
        self,
        store: Store,
        engine: Any,  # engine handle with .options(stream=True)
        base_of: BaseOf,
        first_output: FirstOutput,
        retention_s: float,
        orphan_after_s: float,
        conversation_retention_s: float,
    ) -> None:
        self.store = store
        self.conversation_retention_s = conversation_retention_s
        self.engine = engine
        self.base_of = base_of
        self.first_output = first_output
        self.retention_s = retention_s
        self.orphan_after_s = orphan_after_s
        self.live: dict[str, LiveResponse] = {}
        self.channels = EngineChannels(engine)
        self.tasks = OwnedTasks()

    # ------------------------------------------------------------------ requests

    async def start(self, admitted: AdmittedResponse) -> LiveResponse:
        """Start the run; returns once it is recorded (background: queued) or, in the
        foreground, once its first output came (an engine refusal raises, nothing stored)."""
        live = LiveResponse(admitted, self.base_of(admitted))
        self.tasks.spawn(self._run(live))
        await asyncio.wait([live.accepted])  # a disconnect stops this wait, not the run
        live.accepted.result()
        return live

    def find(self, tenant: str, response_id: str) -> LiveResponse | None:
        live = self.live.get(response_id)
        return live if live is not None and live.admitted.tenant == tenant else None

    async def cancel(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        """Idempotent: the response after the request (completion may win the race)."""
        live = self.find(tenant, response_id)
        if live is not None:
            live.request_cancel()
            await asyncio.wait([live.done])
            return live.done.result()
        record = await asyncio.to_thread(self.store.get_response, tenant, response_id)
        if record is not None and record.status in RUNNING:
            # Owned by another process: its next write fails, it stops and ends the record.
            cancelling = replace(record, status="cancelling")
            await asyncio.to_thread(self.store.update_response, cancelling, RUNNING)
        while record is not None and record.status in UNFINISHED:
            if time.time() - record.data.get("written_at", 0.0) > CANCEL_WAIT_S:
                record = await self._end_stored(record, "cancelled", None)  # no owner left
                break
            await asyncio.sleep(FOLLOW_POLL_S)
            record = await asyncio.to_thread(self.store.get_response, tenant, response_id)
        return None if record is None else record.data["response"]

    async def record(self, tenant: str, response_id: str) -> ResponseRecord | None:
        """The stored record; one whose owner is gone is ended `engine_lost` first."""
        record = await asyncio.to_thread(self.store.get_response, tenant, response_id)
        if record is None or record.status not in UNFINISHED or self.find(tenant, response_id):
            return record
        if time.time() - record.data.get("written_at", 0.0) < self.orphan_after_s:
            return record
        error = {
            "code": "engine_lost",
            "message": "the server process running this response was lost",
        }
        logger.warning("response %s lost its owner: failed (engine_lost)", response_id)
        return await self._end_stored(record, "failed", error)

    def follow_live(
        self, tenant: str, response_id: str, index: int
    ) -> AsyncIterator[list[Event]] | None:
        """The events from `index` of a response this process runs, in batches until its
        terminal one; None when it does not run it."""
        live = self.find(tenant, response_id)
        return None if live is None else follow_live_events(live, index)

    async def follow_batches(
        self, tenant: str, response_id: str, after: int
    ) -> AsyncIterator[list[Event]]:
        """The events after sequence number `after`, every event ready at once as one batch:
        from memory while this process runs it, else from the store, polled until its
        terminal event."""
        index = after + 1
        while True:
            live = self.find(tenant, response_id)
            if live is not None:
                async for batch in follow_live_events(live, index):
                    yield batch
                return
            record = await self.record(tenant, response_id)
            if record is None:
                return  # deleted while read
            # Read after the record: they reach at least as far as its status says.
            events = await asyncio.to_thread(
                self.store.get_response_events, tenant, response_id, index - 1
            )
            events, ended = until_terminal(events)
            if ended:
                yield events
                return
            if events:
                yield events
                index = events[-1]["sequence_number"] + 1
            if record.status not in UNFINISHED:
                return
            await asyncio.sleep(FOLLOW_POLL_S)

    # ------------------------------------------------------------------- one run

    async def _run(self, live: LiveResponse) -> None:
        adm = live.admitted
        try:
            await self._execute(live)
        except Exception as exc:
            logger.exception("response %s failed in the runner", adm.response_id)
            live.accept(exc)
            if live.num_writes and not live.done.done():  # recorded: end its record
                error = {"code": "internal_error", "message": "internal error"}
                await self._finish(live, live.base("failed", [], self._usage(live), error=error))
        finally:
            self.live.pop(adm.response_id, None)
            if live.stream is not None:
                live.stream.cancel()
            adm.end(_total_tokens(live))  # settles the key's reservation, however it ended

    async def _execute(self, live: LiveResponse) -> None:
        adm = live.admitted
        background = bool(adm.req.background)
        if background:
            live.add({"type": "response.created", "response": live.base("queued", [], None)})
            live.add({"type": "response.queued", "response": live.base("queued", [], None)})
            await self._insert(live, "queued")
            live.accept()
        # Its later outputs come in this process's output channel when the engine replica
        # has it open: a step's outputs of every running response as one item.
        request = replace(adm.engine_request, channel=self.channels.channel_id)
        box = self.channels.expect(request.request_id)
        live.stream = gen = self.engine.generate.remote(request)
        if live.is_cancel_requested:
            gen.cancel()
        heartbeat = asyncio.get_running_loop().create_task(self._heartbeat(live))
        merged = None
        try:
            try:
                first = await self.first_output(gen, self.channels.first_output(gen, box))
            except (Exception, asyncio.CancelledError) as exc:
                if isinstance(exc, asyncio.CancelledError) and not _cancelled_by_request(live):
                    raise
                if not background:
                    live.accept(exc)  # refused before any output: an HTTP error, no record
                    return
                await self._end_early(live, exc)
                return
            if not background:
                await self._insert(live, "in_progress")
                live.accept()
            run = ResponseRun(adm, live.base, self._saver(live), lambda: live.is_cancel_requested)
            live.run = run
            merged = merged_outputs([gen], [box], [first], None, self.channels)
            async for event in run.events(first, _later_outputs(merged), created=not background):
                if is_terminal(event):
                    break  # the saver numbered, stored and published it
                live.add(event)
                if self._is_due(live):
                    await self._flush(live)
        finally:
            heartbeat.cancel()
            if merged is not None:
                await merged.aclose()
            self.channels.release(request.request_id)

    async def _end_early(self, live: LiveResponse, exc: BaseException) -> None:
        """A background response the engine refused before its first output."""
        if live.is_cancel_requested:
            final = live.base("cancelled", [], self._usage(live))
        else:
            found = exc if isinstance(exc, errors.APIError) else errors.api_error_in(exc)
            code = found.code if found is not None else "engine_lost"
            code = "engine_lost" if code == "internal_error" else code
            message = found.message if found is not None else "the engine was lost"
            error = {"code": code, "message": message}
            final = live.base("failed", [], self._usage(live), error=error)
        await self._finish(live, final)

    def _usage(self, live: LiveResponse) -> dict[str, Any]:
        if live.run is not None:
            return live.run.usage()
        return usage(live.admitted.num_prompt_tokens, 0, 0, 0)

    def _saver(self, live: LiveResponse) -> Any:
        async def save(adm: AdmittedResponse, final: dict[str, Any]) -> dict[str, Any] | None:
            return await self._finish(live, final)

        return save

    async def _finish(self, live: LiveResponse, final: dict[str, Any]) -> dict[str, Any] | None:
        """Store the terminal event with the response, then publish it; None when this
        run's ending was stored, else the ending the store already held."""
        final = await self._add_to_conversation(live, final)
        terminal = {"type": f"response.{final['status']}", "response": final}
        terminal["sequence_number"] = len(live.events)
        stored: dict[str, Any] | None = None
        if not await self._write(live, final, UNFINISHED, terminal):
            current = await asyncio.to_thread(
                self.store.get_response, live.admitted.tenant, live.id
            )
            if current is not None:
                stored = current.data["response"]
                terminal = {"type": f"response.{stored['status']}", "response": stored}
        live.add(terminal)
        if not live.done.done():
            live.done.set_result(stored or final)
        return stored

    async def _add_to_conversation(
        self, live: LiveResponse, final: dict[str, Any]
    ) -> dict[str, Any]:
        """A response in a conversation that completed (or stopped at its length) appends
        its input and output items there, before its terminal event is stored: a client that
        sees it ended reads them in the conversation. When the conversation refuses them
        (deleted, or a generation holds its next turn), the response fails saying so; its
        output is still in the response."""
        adm = live.admitted
        if adm.conversation_id is None or final["status"] not in ("completed", "incomplete"):
            return final
        items = adm.input_items + final["output"]
        try:
            await append_items(
                self.store, adm.tenant, adm.conversation_id, items,
                expected_revision=None, retention_s=self.conversation_retention_s,
            )  # fmt: skip
        except errors.APIError as exc:
            message = f"The items were not added to the conversation: {exc.message}"
            error = {"code": exc.code, "message": message}
            return {**final, "status": "failed", "error": error, "incomplete_details": None}
        return final

    # ---------------------------------------------------------------- the record

    def _is_due(self, live: LiveResponse) -> bool:
        pending = len(live.events) - live.num_flushed
        return pending >= FLUSH_EVENTS or time.monotonic() - live.flushed_at >= FLUSH_PERIOD_S

    async def _heartbeat(self, live: LiveResponse) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_PERIOD_S)
            if time.monotonic() - live.flushed_at >= HEARTBEAT_PERIOD_S:
                await self._flush(live)

    async def _flush(self, live: LiveResponse) -> None:
        if live.num_writes == 0 or live.done.done():
            return  # not recorded yet, or ended
        run = live.run
        items = run.items.items if run is not None else []
        status = "in_progress" if run is not None else live.events[-1]["response"]["status"]
        if not await self._write(live, live.base(status, items, None), RUNNING):
            live.request_cancel()  # ended elsewhere: a cancel another replica wrote

    async def _insert(self, live: LiveResponse, status: str) -> None:
        current = live.base(status, [], None)
        record = self._record_of(live, status, self._data(live, current))
        events = list(live.events)
        live.flushed_at = time.monotonic()
        await asyncio.to_thread(self.store.insert_response, record, events)
        live.num_writes += 1
        live.num_flushed = len(events)
        self.live[live.id] = live

    async def _write(
        self,
        live: LiveResponse,
        response: dict[str, Any],
        expected: tuple[str, ...],
        terminal: Event | None = None,
    ) -> bool:
        """Rewrite the record with `response` and append the events not stored yet (then
        `terminal`, not published yet), if its status is `expected`."""
        async with live.lock:
            # Sliced under the lock: a heartbeat and a batch never append the same events.
            num_events = len(live.events)
            events = live.events[live.num_flushed : num_events]
            if terminal is not None:
                events.append(terminal)
            record = self._record_of(live, response["status"], self._data(live, response))
            live.flushed_at = time.monotonic()
            live.num_writes += 1
            args = (record, expected, events)
            if not await asyncio.to_thread(self.store.update_response, *args):
                return False
            live.num_flushed = num_events
            return True

    def _data(self, live: LiveResponse, response: dict[str, Any]) -> dict[str, Any]:
        adm = live.admitted
        context = adm.context
        if response["status"] not in UNFINISHED:
            context = context + context_messages(response["output"])
        return {
            "response": response,
            "input_items": adm.input_items,
            "context": context,
            "written_at": time.time(),
            "idempotency": adm.idempotency,
            "store_writes": live.num_writes + 1,
        }

    def _record_of(self, live: LiveResponse, status: str, data: dict[str, Any]) -> ResponseRecord:
        adm = live.admitted
        expires_at = time.time() + self.retention_s
        return ResponseRecord(adm.response_id, adm.tenant, status, data, adm.created_at, expires_at)

    async def _end_stored(
        self, record: ResponseRecord, status: str, error: dict[str, str] | None
    ) -> ResponseRecord:
        """End a record this process does not run, with its terminal event."""
        response = {**record.data["response"], "status": status, "error": error}
        events = await asyncio.to_thread(
            self.store.get_response_events, record.tenant, record.id, -1
        )
        terminal = {
            "type": f"response.{status}",
            "response": response,
            "sequence_number": len(events),
        }
        ended = replace(record, status=status, data={**record.data, "response": response})
        if await asyncio.to_thread(self.store.update_response, ended, UNFINISHED, [terminal]):
            return ended
        current = await asyncio.to_thread(self.store.get_response, record.tenant, record.id)
        return current or ended


def _total_tokens(live: LiveResponse) -> int:
    """What the response used: its final usage; 0 when it never ran (refused, a replay)."""
    if not live.done.done():
        return 0
    usage = live.done.result().get("usage") or {}
    return int(usage.get("total_tokens") or 0)


def _cancelled_by_request(live: LiveResponse) -> bool:
    """A CancelledError from the engine stream a cancel stopped, not of this task."""
    task = asyncio.current_task()
    return live.is_cancel_requested and (task is None or task.cancelling() == 0)


async def _later_outputs(merged: Merged) -> AsyncIterator[RequestOutput]:
    """The merged stream's outputs one by one, after the first (the run has it)."""
    first = True
    async for ready in merged:
        for _, out in ready:
            if first:
                first = False
            elif out is not None:
                yield out
