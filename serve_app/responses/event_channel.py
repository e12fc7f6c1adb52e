"""One multiplexed event channel per (ingress replica, runner replica) pair.

A stored response runs in the runner deployment and its reader's HTTP request in an ingress
replica, so every event crosses a process boundary. Followed one Serve call per response, a
token stream costs both sides a Serve item (a gRPC message, its serialization, event-loop
handoffs) per token. A channel carries the events every followed response produced since the
last item as one item instead, as the engine's output channels do for chat
(`serve_app/workers/output_channel.py`):

- The ingress opens one channel (`ResponseRunnerService.event_channel`, a streamed call, in
  an empty context so that no client's disconnect cancels it) when a reader finds none open.
- A reader subscribes (`subscribe`, a plain call) with an id of its own; the runner replica
  that receives it follows the response from memory into the channel when it runs the
  response and has this ingress's channel open, and answers False otherwise.
- Whatever a subscription cannot get from the channel (no channel, the response not live on
  that replica, the channel lost, a reader too far behind) it reads through the per-response
  follow call from the last event it received: the events are numbered, so nothing is missed
  or repeated.
- A reader that leaves unsubscribes; a channel with no subscription for `IDLE_S` ends.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from serve_app.responses.output import Event

logger = logging.getLogger(__name__)

# A channel with no subscription ends after this long.
IDLE_S = 5.0
# A reader this many events behind leaves the channel (and reads through its own call, whose
# Serve stream has its own flow control): the ingress never buffers a response without bound.
MAX_PENDING_EVENTS = 4096

# One channel item: (subscription id, events) pairs in the order they were produced.
Batch = list[tuple[str, list[Event]]]


class _Outbox:
    def __init__(self) -> None:
        self.items: Batch = []
        self.subscriptions: dict[str, asyncio.Task] = {}
        self._ready = asyncio.Event()

    def put(self, sub_id: str, events: list[Event]) -> None:
        self.items.append((sub_id, events))
        self._ready.set()

    async def take(self, idle_s: float) -> Batch | None:
        """Everything queued, once there is something; None once idle for `idle_s`."""
        while not self.items:
            try:
                await asyncio.wait_for(self._ready.wait(), idle_s)
            except TimeoutError:
                if not self.items and not self.subscriptions:
                    return None
            self._ready.clear()
        batch, self.items = self.items, []
        return batch


class EventHub:
    """The runner replica's side: an outbox per ingress channel, and a task per subscription
    following one live response into it."""

    def __init__(
        self,
        follow_live: Callable[[str, str, int], AsyncIterator[list[Event]] | None],
        idle_s: float = IDLE_S,
    ) -> None:
        # follow_live(tenant, response_id, index): the live response's events from `index`
        # in batches until its terminal one; None when this process does not run it.
        self.follow_live = follow_live
        self.idle_s = idle_s
        self._outboxes: dict[str, _Outbox] = {}

    async def serve(self, channel_id: str) -> AsyncIterator[str | Batch]:
        """The channel call's items: a hello (this replica's id), then one batch per wake-up,
        until idle."""
        if channel_id in self._outboxes:
            return  # that ingress has its channel here already
        box = self._outboxes[channel_id] = _Outbox()
        try:
            yield channel_id
            while (batch := await box.take(self.idle_s)) is not None:
                yield batch
        finally:
            del self._outboxes[channel_id]
            for task in box.subscriptions.values():
                task.cancel()

    def subscribe(self, channel_id: str, sub_id: str, tenant: str, rid: str, after: int) -> bool:
        box = self._outboxes.get(channel_id)
        if box is None:
            return False
        batches = self.follow_live(tenant, rid, after + 1)
        if batches is None:
            return False
        task = asyncio.get_running_loop().create_task(
            self._pump(box, sub_id, batches), context=contextvars.Context()
        )
        box.subscriptions[sub_id] = task
        return True

    def unsubscribe(self, channel_id: str, sub_id: str) -> None:
        box = self._outboxes.get(channel_id)
        task = box.subscriptions.pop(sub_id, None) if box is not None else None
        if task is not None:
            task.cancel()

    @staticmethod
    async def _pump(box: _Outbox, sub_id: str, batches: AsyncIterator[list[Event]]) -> None:
        try:
            async for events in batches:
                box.put(sub_id, events)
        finally:
            box.subscriptions.pop(sub_id, None)


class _Subscription:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[list[Event] | None] = asyncio.Queue()
        self.pending = 0
        self.overflowed = False

    def put(self, events: list[Event]) -> None:
        if self.overflowed:
            return
        self.pending += len(events)
        if self.pending > MAX_PENDING_EVENTS:
            self.overflowed = True
            self.queue.put_nowait(None)
            return
        self.queue.put_nowait(events)

    async def get(self) -> list[Event] | None:
        events = await self.queue.get()
        if events is not None:
            self.pending -= len(events)
        return events


class EventChannels:
    """The ingress replica's side: the channel it has open to the runner deployment, and the
    subscriptions reading from it."""

    def __init__(self, handle: Any, is_terminal: Callable[[Event], bool]) -> None:
        self.handle = handle
        self.is_terminal = is_terminal
        self.channel_id = uuid.uuid4().hex
        self.is_open = False
        self._subscriptions: dict[str, _Subscription] = {}
        self._reader: asyncio.Task | None = None
        self._sending: set[asyncio.Task] = set()

    async def follow(self, tenant: str, rid: str, after: int) -> AsyncIterator[Event]:
        """The events after `after` from the channel, as long as it carries them; returns
        without the terminal event when the caller must read the rest through its own call
        (from the last event yielded)."""
        if not self.is_open:
            self._open()
            return
        sub_id = uuid.uuid4().hex
        sub = self._subscriptions[sub_id] = _Subscription()
        subscribed = False
        try:
            subscribed = await self.handle.subscribe.remote(
                self.channel_id, sub_id, tenant, rid, after
            )
            if not subscribed:
                return
            while (events := await sub.get()) is not None:
                for event in events:
                    yield event
                    if self.is_terminal(event):
                        subscribed = False  # its pump ended with it
                        return
        finally:
            del self._subscriptions[sub_id]
            if subscribed:
                self._unsubscribe(sub_id)

    def _open(self) -> None:
        if self._reader is None:
            # NOTE: an empty context: Serve cancels the handle calls made in a request's
            # context when its client leaves, and the channel serves every reader.
            self._reader = asyncio.get_running_loop().create_task(
                self._read(), context=contextvars.Context()
            )

    def _unsubscribe(self, sub_id: str) -> None:
        async def send() -> None:
            try:
                await self.handle.unsubscribe.remote(self.channel_id, sub_id)
            except Exception as exc:  # noqa: BLE001 (the channel's end cancels it anyway)
                logger.info("unsubscribe failed: %s", type(exc).__name__)

        # Held until done: the loop keeps only a weak reference to a task.
        task = asyncio.get_running_loop().create_task(send(), context=contextvars.Context())
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _read(self) -> None:
        gen = self.handle.options(stream=True).event_channel.remote(self.channel_id)
        try:
            async for item in gen:
                if isinstance(item, str):
                    self.is_open = True
                    continue
                for sub_id, events in item:
                    sub = self._subscriptions.get(sub_id)
                    if sub is not None:
                        sub.put(events)
        except Exception as exc:  # noqa: BLE001 (the runner replica died: readers go on alone)
            logger.info("event channel lost: %s", type(exc).__name__)
        finally:
            self.is_open = False
            self._reader = None
            for sub in self._subscriptions.values():
                sub.queue.put_nowait(None)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
