"""The multiplexed output channel between an ingress replica and an engine replica, both
sides in one event loop: outputs arrive in order and complete, a lagging reader holds its
requests back, and a channel that ends never leaves a request waiting or ends it as a
success."""

from __future__ import annotations

import asyncio
import contextvars
import pickle

import pytest

from actors.messages import TokenLogprobs
from actors.outputs import CompletionDelta, RequestOutput
from serve_app.workers.output_channel import (
    ChannelClosed,
    ChannelHello,
    ChannelHub,
    EngineChannels,
    Routed,
    lost_output,
)


def output(request_id: str, i: int, finished: bool = False) -> RequestOutput:
    delta = CompletionDelta(0, [i], f"t{i}")
    return RequestOutput(request_id, [1, 2, 3], [delta], 0, finished)


class FakeCall:
    """What `handle.options(stream=True).channel.remote(id)` returns, over a local hub."""

    def __init__(self, hub: ChannelHub, channel_id: str):
        self._gen = hub.serve(channel_id)

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._gen.__anext__()

    def cancel(self) -> None:
        asyncio.ensure_future(self._gen.aclose())


class FakeEngine:
    def __init__(self, hub: ChannelHub):
        self.hub = hub
        self.channel = self
        self.opened = 0

    def remote(self, channel_id: str) -> FakeCall:
        self.opened += 1
        return FakeCall(self.hub, channel_id)


async def open_channel(channels: EngineChannels) -> None:
    channels.want()
    for _ in range(100):
        if channels.replicas:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the channel never opened")


async def one_request(request_id: str):
    """An engine replica's hub with this ingress's channel open, and one request of it:
    (hub, channels, the request's mailbox, the request's outbox)."""
    hub = ChannelHub("replica-a", capacity=64)
    channels = EngineChannels(FakeEngine(hub))
    await open_channel(channels)
    return hub, channels, channels.expect(request_id), hub.attach(channels.channel_id)


def collector() -> tuple[list[RequestOutput], callable]:
    got: list[RequestOutput] = []
    return got, got.append


def test_outputs_of_many_requests_arrive_in_order_and_complete() -> None:
    async def main() -> None:
        hub = ChannelHub("replica-a", capacity=64)
        channels = EngineChannels(FakeEngine(hub))
        await open_channel(channels)
        boxes, got = {}, {}
        for r in ("r1", "r2", "r3"):
            boxes[r] = channels.expect(r)
            box = hub.attach(channels.channel_id)
            assert box is not None
            channels.routed(boxes[r], Routed("replica-a", box.instance, output(r, 0)))
            got[r], deliver = collector()
            boxes[r].attach(deliver)
            for i in range(5):
                await hub.push(box, r, output(r, i, finished=i == 4))
        await asyncio.sleep(0.05)
        for r in got:
            assert [o.deltas[0].token_ids[0] for o in got[r]] == [0, 1, 2, 3, 4]
            assert got[r][-1].finished and boxes[r].done
            # The prompt is the ingress's already: later outputs do not carry it again.
            assert all(o.prompt_token_ids == [] for o in got[r])
        stats = hub.stats()
        assert stats["channel_outputs"] == 15
        assert stats["channel_items"] < 15  # outputs of one wake-up travel as one item
        channels.close()

    asyncio.run(main())


def test_outputs_that_arrive_before_the_reader_attaches_wait_for_it() -> None:
    async def main() -> None:
        hub, channels, mailbox, box = await one_request("r1")
        for i in range(3):
            await hub.push(box, "r1", output("r1", i, finished=i == 2))
        await asyncio.sleep(0.05)  # delivered before the call said `Routed`
        channels.routed(mailbox, Routed("replica-a", box.instance, output("r1", 0)))
        got, deliver = collector()
        mailbox.attach(deliver)
        assert [o.deltas[0].token_ids[0] for o in got] == [0, 1, 2]
        channels.close()

    asyncio.run(main())


class OneItemCall:
    """A request's call that yields `items` and fails if read past them."""

    def __init__(self, items: list) -> None:
        self.items = list(items)

    async def __anext__(self):
        if not self.items:
            raise AssertionError("read past the call's items")
        return self.items.pop(0)


def test_the_first_output_rides_in_the_routed_item() -> None:
    """Every item of a Serve call costs both processes a gRPC message: a channelled request's
    call carries one, `Routed` with its first output, and the ingress reads no more of it."""

    async def main() -> None:
        _, channels, mailbox, box = await one_request("r1")
        first = output("r1", 0)
        out = await channels.first_output(
            OneItemCall([Routed("replica-a", box.instance, first)]), mailbox
        )
        assert out is first and mailbox.instance == box.instance
        channels.close()

    asyncio.run(main())


def test_a_channelled_call_yields_one_item_and_the_rest_go_into_the_channel() -> None:
    """The engine replica's side (`EngineService.generate`) over a stand-in engine."""
    from types import SimpleNamespace

    from actors.messages import EngineRequest
    from actors.sampling_params import SamplingParams
    from serve_app.workers.engine import EngineService

    async def engine_outputs(request_id, *args, **kwargs):
        for i in range(4):
            yield output(request_id, i, finished=i == 3)

    async def watch(request, outputs):
        async for out in outputs:
            yield out

    async def main() -> None:
        hub = ChannelHub("replica-a", capacity=64)
        channel = hub.serve("ingress-1")
        hello = await channel.__anext__()
        service = SimpleNamespace(
            engine=SimpleNamespace(generate=engine_outputs),
            timelines=SimpleNamespace(watch=watch),
            flow=None,
            channels=hub,
            replica_id="replica-a",
        )
        request = EngineRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4), channel="ingress-1")
        items = [item async for item in EngineService.generate(service, request)]
        assert len(items) == 1 and isinstance(items[0], Routed)
        assert items[0].channel_instance == hello.instance
        assert items[0].first.deltas[0].token_ids == [0]
        batch = await channel.__anext__()
        assert [(r, o.deltas[0].token_ids[0]) for r, o in batch] == [
            ("r1", 1),
            ("r1", 2),
            ("r1", 3),
        ]
        assert batch[-1][1].finished
        await channel.aclose()

    asyncio.run(main())


def test_a_second_channel_from_the_same_ingress_ends_at_once() -> None:
    async def main() -> None:
        hub = ChannelHub("replica-a", capacity=8)
        first = hub.serve("ingress-1")
        hello = await first.__anext__()
        assert not hello.duplicate
        second = [item async for item in hub.serve("ingress-1")]
        assert len(second) == 1 and second[0].duplicate
        assert hub.stats()["output_channels"] == 1
        await first.aclose()
        assert hub.stats()["output_channels"] == 0

    asyncio.run(main())


def test_an_idle_channel_ends_and_later_requests_use_their_own_call() -> None:
    async def main() -> None:
        hub = ChannelHub("replica-a", capacity=8, idle_s=0.05)
        items = [item async for item in hub.serve("ingress-1")]  # ends by itself
        assert len(items) == 1
        assert hub.attach("ingress-1") is None
        assert hub.stats()["output_channels"] == 0

    asyncio.run(main())


def test_a_channel_with_a_request_attached_stays_open_past_its_idle_time() -> None:
    async def main() -> None:
        hub = ChannelHub("replica-a", capacity=8, idle_s=0.05)
        gen = hub.serve("ingress-1")
        await gen.__anext__()
        box = hub.attach("ingress-1")
        nxt = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.2)
        assert not nxt.done() and not box.closed
        await hub.push(box, "r1", output("r1", 0, finished=True))
        batch = await nxt
        assert [rid for rid, _ in batch] == ["r1"] and batch[0][1].finished
        hub.detach(box)
        with pytest.raises(StopAsyncIteration):
            await gen.__anext__()  # idle again: the channel ends

    asyncio.run(main())


def test_a_lagging_channel_reader_holds_the_request_back_at_capacity() -> None:
    async def main() -> None:
        hub = ChannelHub("replica-a", capacity=2)
        gen = hub.serve("ingress-1")
        await gen.__anext__()
        box = hub.attach("ingress-1")
        await hub.push(box, "r1", output("r1", 0))
        third = asyncio.ensure_future(hub.push(box, "r1", output("r1", 1)))
        await asyncio.sleep(0.05)
        assert not third.done()  # two queued and nobody reading: the producer waits
        batch = await gen.__anext__()
        assert [rid for rid, _ in batch] == ["r1", "r1"]
        await asyncio.wait_for(third, 1)
        await gen.aclose()
        with pytest.raises(ChannelClosed):
            await hub.push(box, "r1", output("r1", 2))

    asyncio.run(main())


def test_a_channel_that_ends_fails_its_waiting_requests_as_engine_lost() -> None:
    async def main() -> None:
        hub = ChannelHub("replica-a", capacity=8)
        engine = FakeEngine(hub)
        channels = EngineChannels(engine)
        await open_channel(channels)
        mailbox = channels.expect("r1")
        box = hub.attach(channels.channel_id)
        channels.routed(mailbox, Routed("replica-a", box.instance, output("r1", 0)))
        got, deliver = collector()
        mailbox.attach(deliver)
        await hub.push(box, "r1", output("r1", 0))
        await asyncio.sleep(0.05)
        channels.close()  # the reader goes (as when the replica's call fails)
        await asyncio.sleep(0.05)
        assert len(got) == 2
        assert got[-1].finished and got[-1].error_code == "engine_lost"
        # A request routed to that channel after it ended fails at once, never waits.
        late = channels.expect("r2")
        channels.routed(late, Routed("replica-a", box.instance, output("r2", 0)))
        late_got, deliver = collector()
        late.attach(deliver)
        assert late_got and late_got[0].error_code == "engine_lost"

    asyncio.run(main())


def test_an_unchannelled_request_opens_one_channel_at_a_time() -> None:
    async def main() -> None:
        hub = ChannelHub("replica-a", capacity=8)
        engine = FakeEngine(hub)
        channels = EngineChannels(engine)
        for r in ("r1", "r2", "r3"):
            channels.routed(channels.expect(r), Routed("replica-a", None, output(r, 0)))
        await asyncio.sleep(0.05)
        assert engine.opened == 1 and "replica-a" in channels.replicas
        channels.close()

    asyncio.run(main())


REQUEST = contextvars.ContextVar("request", default=None)


def test_a_channel_is_no_child_of_the_request_that_opened_it() -> None:
    """Serve cancels every handle call made in a request's context when its client leaves:
    the channel, which every request of this ingress shares, must not be one of them."""

    class RecordingEngine(FakeEngine):
        def remote(self, channel_id: str) -> FakeCall:
            self.opened_in = REQUEST.get()
            return super().remote(channel_id)

    async def main() -> None:
        engine = RecordingEngine(ChannelHub("replica-a", capacity=8))
        channels = EngineChannels(engine)

        async def request() -> None:
            REQUEST.set("the request that came back unchannelled")
            channels.routed(channels.expect("r1"), Routed("replica-a", None, output("r1", 0)))

        await asyncio.create_task(request())
        for _ in range(100):
            if channels.replicas:
                break
            await asyncio.sleep(0.01)
        assert engine.opened == 1 and engine.opened_in is None
        channels.close()

    asyncio.run(main())


def test_what_the_engine_replica_sends_round_trips_through_plain_pickle() -> None:
    """Over gRPC the engine handle's replies use Serve's `pickle` serializer
    (serve_app.ray_env), which, unlike cloudpickle, cannot carry a lambda or a class made at
    run time: every kind of item the engine replica sends comes back equal, every field
    set."""
    logprobs = [TokenLogprobs(-0.5, 1, [(5, -0.5), (6, -1.5)])]
    delta = CompletionDelta(1, [5], "x", logprobs, "stop", "</s>")
    last = RequestOutput(
        "r@2", [1, 2], [delta], 1, True, "failed", "engine_lost", {"first_token": 0.1}, 2, [None]
    )
    items = [
        Routed("replica", "replica/0", output("r@0", 7)),
        ChannelHello("replica", "replica/0", duplicate=True),
        last,
        lost_output("the output channel was closed"),
        [("r", output("r@0", 7)), ("s", last)],
    ]
    for item in items:
        assert pickle.loads(pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)) == item
