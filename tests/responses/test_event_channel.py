"""The runner's event channel (`serve_app/responses/event_channel.py`), both sides in one
loop through a fake Serve handle: followed responses share one item per wake-up, each reader
gets exactly its own events in order, a reader that leaves unsubscribes, and a lost channel
or a reader too far behind hands the rest to the per-response call without a gap."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from serve_app.responses import event_channel
from serve_app.responses.event_channel import EventChannels, EventHub
from serve_app.responses.live import is_terminal

NUM_TOKENS = 20


def events_of(rid: str, n: int = NUM_TOKENS) -> list[dict]:
    deltas = [{"type": "response.output_text.delta", "delta": f"{rid}-{i}"} for i in range(n)]
    ended = [*deltas, {"type": "response.completed", "response": {"id": rid}}]
    return [{**e, "sequence_number": i} for i, e in enumerate(ended)]


class LiveSource:
    """What `ResponseRunner.follow_live` gives: each running response's events from an
    index, one event per engine step, every response stepped together."""

    def __init__(self, rids: list[str], step_s: float = 0.002) -> None:
        self.events = {rid: events_of(rid) for rid in rids}
        self.step_s = step_s
        self.following = 0

    def __call__(self, tenant: str, rid: str, index: int) -> AsyncIterator[list[dict]] | None:
        return self._follow(rid, index) if rid in self.events else None

    async def _follow(self, rid: str, index: int) -> AsyncIterator[list[dict]]:
        self.following += 1
        try:
            for event in self.events[rid][index:]:
                await asyncio.sleep(self.step_s)
                yield [event]
        finally:
            self.following -= 1


class Call:
    """A Serve call as the ingress awaits or iterates it."""

    def __init__(self, result: Any) -> None:
        self.result = result

    def __await__(self):
        async def value() -> Any:
            await asyncio.sleep(0)
            return self.result

        return value().__await__()

    def __aiter__(self):
        return self.result.__aiter__()


class Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Call:
        return Call(self.fn(*args))


class FakeHandle:
    """The runner deployment's handle, calling one EventHub in this loop; counts the
    channel's items."""

    def __init__(self, hub: EventHub) -> None:
        self.hub = hub
        self.items = 0
        self.subscribe = Method(hub.subscribe)
        self.unsubscribe = Method(hub.unsubscribe)
        self.event_channel = Method(self._serve)
        self.lost = asyncio.Event()

    def options(self, **_: Any) -> FakeHandle:
        return self

    async def _serve(self, channel_id: str) -> AsyncIterator[Any]:
        async for item in self.hub.serve(channel_id):
            if self.lost.is_set():
                raise RuntimeError("the runner replica died")
            if not isinstance(item, str):
                self.items += 1
            yield item


async def open_channels(handle: FakeHandle) -> EventChannels:
    channels = EventChannels(handle, is_terminal)
    assert [e async for e in channels.follow("t", "r0", -1)] == []  # none open: it opens one
    for _ in range(100):
        if channels.is_open:
            return channels
        await asyncio.sleep(0.001)
    raise AssertionError("the channel did not open")


async def read(channels: EventChannels, rid: str, after: int = -1, upto: int | None = None):
    got = []
    async for event in channels.follow("t", rid, after):
        got.append(event)
        if upto is not None and len(got) == upto:
            break
    return got


def test_followed_responses_share_the_channels_items_and_each_reader_gets_its_own_events():
    async def go() -> None:
        rids = [f"r{i}" for i in range(6)]
        source = LiveSource(rids)
        handle = FakeHandle(EventHub(source))
        channels = await open_channels(handle)
        got = await asyncio.gather(*(read(channels, rid) for rid in rids))
        for rid, events in zip(rids, got, strict=True):
            assert events == events_of(rid)
        num_events = len(rids) * (NUM_TOKENS + 1)
        assert handle.items < num_events / 2  # several responses' events per item
        channels.close()

    asyncio.run(go())


def test_a_reader_after_n_gets_the_events_after_n():
    async def go() -> None:
        channels = await open_channels(FakeHandle(EventHub(LiveSource(["r1"]))))
        assert await read(channels, "r1", after=7) == events_of("r1")[8:]
        channels.close()

    asyncio.run(go())


def test_a_reader_that_leaves_unsubscribes_and_its_follow_stops():
    async def go() -> None:
        source = LiveSource(["r1"], step_s=0.01)
        hub = EventHub(source)
        channels = await open_channels(FakeHandle(hub))
        reader = read(channels, "r1", upto=3)
        assert len(await reader) == 3
        for _ in range(100):
            if source.following == 0:
                break
            await asyncio.sleep(0.005)
        assert source.following == 0
        assert all(not box.subscriptions for box in hub._outboxes.values())
        channels.close()

    asyncio.run(go())


def test_a_response_not_live_on_the_replica_is_left_to_its_own_call():
    async def go() -> None:
        channels = await open_channels(FakeHandle(EventHub(LiveSource(["r1"]))))
        assert await read(channels, "elsewhere") == []
        channels.close()

    asyncio.run(go())


def test_a_lost_channel_ends_the_channel_part_without_a_gap():
    async def go() -> None:
        handle = FakeHandle(EventHub(LiveSource(["r1"], step_s=0.01)))
        channels = await open_channels(handle)
        got = []
        async for event in channels.follow("t", "r1", -1):
            got.append(event)
            if len(got) == 4:
                handle.lost.set()
        assert got == events_of("r1")[: len(got)] and not is_terminal(got[-1])
        assert not channels.is_open  # the next reader reopens one

    asyncio.run(go())


def test_a_reader_too_far_behind_leaves_the_channel(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(event_channel, "MAX_PENDING_EVENTS", 5)

    async def go() -> None:
        source = LiveSource(["r1"], step_s=0.001)
        channels = await open_channels(FakeHandle(EventHub(source)))
        got = []
        async for event in channels.follow("t", "r1", -1):
            got.append(event)
            await asyncio.sleep(0.02)  # a stalled client
        assert got == events_of("r1")[: len(got)] and len(got) < NUM_TOKENS
        channels.close()

    asyncio.run(go())
