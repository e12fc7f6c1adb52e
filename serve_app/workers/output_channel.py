"""One multiplexed output channel per (ingress replica, engine replica) pair.

Through Serve, each item of a streamed call costs both sides a gRPC message, its
serialization and a few event-loop handoffs, whatever its size; a token stream is one item
per token. A channel carries every output a step produced for one ingress replica's requests
as one item instead:

- Each request is still its own Serve call (`EngineService.generate`): Serve's router picks
  its replica, its first output decides the status, cancelling the call aborts it within one
  step, and a replica that dies fails the call.
- A request that names its ingress's channel (`EngineRequest.channel`) gets its first output
  in a `Routed` item, which also says which replica took it and whether that replica has this
  ingress's channel open: one item, where every item of a Serve call costs both processes
  its own gRPC message (`benchmarks/serve_hop.py`). If the channel is open, the request's
  later outputs go into it (`ChannelHub.push`), in order, its last one included; the call
  itself yields nothing more and ends with the request. Otherwise they come on the call as
  before.
- The ingress opens a channel (`EngineService.channel`, a streamed call Serve routes like any
  other) when a request of its came back unchannelled; a channel that lands on a replica that
  has one from the same ingress already ends at once (`ChannelHello.duplicate`). A channel with
  no request attached for `IDLE_S` ends, so that an idle replica drains.
- Outputs of one request wait in the channel at most `capacity` deep: past that the request's
  reader stops taking outputs, its engine window fills and the engine holds it, as it does
  for a reader that stops reading its own stream.
- A channel that ends while requests still wait for outputs on it fails them as
  `engine_lost` (`EngineChannels`), never as a short success.

`ChannelHub` runs in the engine replica, `EngineChannels` in the ingress; both on their
process's Serve event loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import uuid
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from actors.outputs import RequestOutput

logger = logging.getLogger(__name__)

# A channel with no request attached ends after this long.
IDLE_S = 2.0
# After a channel call that found a duplicate (or failed), the next open waits this long.
REOPEN_BACKOFF_S = 0.5
# Ended channels an ingress remembers.
MAX_ENDED = 1024


@dataclass
class Routed:
    """A channel-naming request's first item: the replica that took it, the channel its later
    outputs come on (None: they come on the request's own call), and its first output."""

    replica_id: str
    channel_instance: str | None
    first: RequestOutput


@dataclass
class ChannelHello:
    """A channel's first item. `duplicate`: the replica has this ingress's channel already."""

    replica_id: str
    instance: str
    duplicate: bool = False


# One channel item: (engine request id, output) pairs in the order they were produced.
Batch = list[tuple[str, RequestOutput]]


class ChannelClosed(Exception):
    """The channel a request's outputs were going to has ended."""


class _Outbox:
    def __init__(self, instance: str, capacity: int) -> None:
        self.instance = instance
        self.capacity = capacity
        self.items: Batch = []
        self.pending: dict[str, int] = {}
        self.attached = 0
        self.closed = False
        self._ready = asyncio.Event()
        self._drained = asyncio.Event()

    async def take(self, idle_s: float) -> Batch | None:
        """Everything queued, once there is something; None once idle for `idle_s`."""
        while not self.items:
            if self.attached == 0:
                try:
                    await asyncio.wait_for(self._ready.wait(), idle_s)
                except TimeoutError:
                    if not self.items and self.attached == 0:
                        self.closed = True
                        return None
            else:
                await self._ready.wait()
            self._ready.clear()
        batch, self.items = self.items, []
        for request_id, _ in batch:
            left = self.pending[request_id] - 1
            if left:
                self.pending[request_id] = left
            else:
                del self.pending[request_id]
        self._drained.set()
        self._drained.clear()
        return batch

    def put(self, request_id: str, out: RequestOutput) -> None:
        self.items.append((request_id, out))
        self.pending[request_id] = self.pending.get(request_id, 0) + 1
        self._ready.set()

    async def room_for(self, request_id: str) -> None:
        """Wait while `request_id` has `capacity` outputs queued (the channel's reader lags)."""
        while not self.closed and self.pending.get(request_id, 0) >= self.capacity:
            await self._drained.wait()

    def close(self) -> None:
        self.closed = True
        self._drained.set()


class ChannelHub:
    """The engine replica's side: the open channels, by the ingress's channel id."""

    def __init__(self, replica_id: str, capacity: int, idle_s: float = IDLE_S) -> None:
        self.replica_id = replica_id
        self.capacity = max(1, capacity)
        self.idle_s = idle_s
        self._boxes: dict[str, _Outbox] = {}
        self._instances = itertools.count()
        # Since start, over every channel: items sent and the outputs they carried.
        self.num_items = 0
        self.num_outputs = 0

    def attach(self, channel_id: str | None) -> _Outbox | None:
        """The open channel a new request's later outputs go to (None: its own call)."""
        box = self._boxes.get(channel_id) if channel_id is not None else None
        if box is None or box.closed:
            return None
        box.attached += 1
        return box

    @staticmethod
    def detach(box: _Outbox) -> None:
        box.attached -= 1

    @staticmethod
    async def push(box: _Outbox, request_id: str, out: RequestOutput) -> None:
        if box.closed:
            raise ChannelClosed(request_id)
        # The ingress has the prompt already: a later output need not carry it again.
        out.prompt_token_ids = []
        box.put(request_id, out)
        await box.room_for(request_id)

    async def serve(self, channel_id: str) -> AsyncIterator[ChannelHello | Batch]:
        """The channel call's items: a hello, then one batch per wake-up, until idle."""
        if channel_id in self._boxes:
            yield ChannelHello(self.replica_id, "", duplicate=True)
            return
        box = _Outbox(f"{self.replica_id}/{next(self._instances)}", self.capacity)
        self._boxes[channel_id] = box
        try:
            yield ChannelHello(self.replica_id, box.instance)
            while (batch := await box.take(self.idle_s)) is not None:
                self.num_items += 1
                self.num_outputs += len(batch)
                yield batch
        finally:
            box.close()
            if self._boxes.get(channel_id) is box:
                del self._boxes[channel_id]

    def stats(self) -> dict[str, int]:
        return {
            "output_channels": len(self._boxes),
            "channel_items": self.num_items,
            "channel_outputs": self.num_outputs,
        }


@dataclass
class Mailbox:
    """One engine request's outputs as the ingress receives them, from a channel or from
    its own call: buffered until its reader attaches (a channel may deliver before the
    request's call says `Routed`), then handed on as they come; nothing after the last."""

    request_id: str
    instance: str | None = None
    done: bool = False
    _early: list[RequestOutput] = field(default_factory=list)
    _deliver: Callable[[RequestOutput], None] | None = None

    def put(self, out: RequestOutput) -> None:
        if self.done:
            return
        if out.finished:
            self.done = True
        if self._deliver is None:
            self._early.append(out)
        else:
            self._deliver(out)

    def attach(self, deliver: Callable[[RequestOutput], None]) -> None:
        self._deliver = deliver
        early, self._early = self._early, []
        for out in early:
            deliver(out)

    def fail(self, message: str) -> None:
        """End the request as `engine_lost` unless its last output came already."""
        if not self.done:
            self.put(lost_output(message))


def lost_output(message: str) -> RequestOutput:
    lost = RequestOutput("", [], [], 0, True, error=message)
    lost.error_code = "engine_lost"
    return lost


class EngineChannels:
    """The ingress replica's side: a reader task per channel it has open, routing each
    output to its request's mailbox; `want()` opens one more when a request came back
    unchannelled."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine  # a handle with stream=True
        self.channel_id = uuid.uuid4().hex
        # Held weakly: a response dropped before it was read (its client gone before the
        # first byte) takes its mailboxes with it.
        self.mailboxes: weakref.WeakValueDictionary[str, Mailbox] = weakref.WeakValueDictionary()
        self.replicas: dict[str, str] = {}  # replica id -> open channel instance
        # Channels whose reader has ended (the latest few): a request routed to one of them
        # after its end is failed at once, not left waiting.
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._readers: set[asyncio.Task] = set()
        self._opening: asyncio.Task | None = None
        self._next_open_at = 0.0

    def expect(self, request_id: str) -> Mailbox:
        """Before sending a request: where its channel outputs wait."""
        box = self.mailboxes[request_id] = Mailbox(request_id)
        return box

    def routed(self, box: Mailbox, routed: Routed) -> None:
        """A request's call said where its later outputs come."""
        box.instance = routed.channel_instance
        if box.instance is None:
            self.want()
        elif box.instance in self._ended:
            box.fail("the output channel was closed")

    async def first_output(self, gen: Any, box: Mailbox) -> RequestOutput:
        """A channel-naming call's first output, from its `Routed` item (which says where the
        later ones come)."""
        out = await gen.__anext__()
        if isinstance(out, Routed):
            self.routed(box, out)
            out = out.first
        return out

    def release(self, request_id: str) -> None:
        self.mailboxes.pop(request_id, None)

    def want(self) -> None:
        """A request came back unchannelled: open a channel (one open at a time)."""
        loop = asyncio.get_running_loop()
        if self._opening is not None or loop.time() < self._next_open_at:
            return
        # NOTE: in an empty context, not the request's: Serve cancels every handle call made
        # in a request's context when its client leaves, and the channel (and so every
        # request whose outputs it carries) would go with the request that opened it.
        self._opening = loop.create_task(self._open(), context=contextvars.Context())

    async def _open(self) -> None:
        gen = self.engine.channel.remote(self.channel_id)
        try:
            hello = await gen.__anext__()
        except Exception as exc:  # noqa: BLE001 (no replica reachable now: try again later)
            logger.info("output channel not opened: %s", type(exc).__name__)
            self._backoff()
            return
        finally:
            self._opening = None
        if hello.duplicate:
            gen.cancel()
            self._backoff()
            return
        task = asyncio.create_task(self._read(gen, hello))
        self._readers.add(task)
        task.add_done_callback(self._readers.discard)

    def _backoff(self) -> None:
        self._next_open_at = asyncio.get_running_loop().time() + REOPEN_BACKOFF_S

    async def _read(self, gen: Any, hello: ChannelHello) -> None:
        self.replicas[hello.replica_id] = hello.instance
        reason = "the engine replica was lost"
        try:
            async for batch in gen:
                for request_id, out in batch:
                    box = self.mailboxes.get(request_id)
                    if box is not None:
                        box.put(out)
        except asyncio.CancelledError:
            reason = "the output channel was closed"
            raise
        except Exception as exc:  # noqa: BLE001 (the replica died or its call failed)
            logger.error("output channel lost: %s", type(exc).__name__)
        finally:
            if self.replicas.get(hello.replica_id) == hello.instance:
                del self.replicas[hello.replica_id]
            self._ended[hello.instance] = None
            while len(self._ended) > MAX_ENDED:
                self._ended.popitem(last=False)
            for box in list(self.mailboxes.values()):
                if box.instance == hello.instance:
                    box.fail(reason)

    def close(self) -> None:
        for task in list(self._readers):
            task.cancel()
        if self._opening is not None:
            self._opening.cancel()
