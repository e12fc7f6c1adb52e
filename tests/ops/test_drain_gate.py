"""The ingress's reading of the draining flag: never older than its period when a request is
admitted, refreshed ahead of that in the background, one reading at a time, and kept when the
admin deployment does not answer."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.ops.drain_gate import DrainGate
from tests.support.clock import ManualClock


class Admin:
    """The admin deployment's flag: each reading takes `latency_s` of real time."""

    def __init__(self, latency_s: float = 0.02) -> None:
        self.flag = False
        self.latency_s = latency_s
        self.reads = 0
        self.fail = False

    async def read(self) -> bool:
        self.reads += 1
        await asyncio.sleep(self.latency_s)
        if self.fail:
            raise RuntimeError("admin replica restarting")
        return self.flag


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def test_a_stale_reading_is_refreshed_before_the_request_is_admitted(clock):
    admin = Admin()
    gate = DrainGate(admin.read, period_s=0.5, prefetch_s=0.25, clock=clock)

    async def run():
        assert await gate.is_draining() is False  # the first request reads the flag itself
        admin.flag = True
        clock.now += 0.1
        assert await gate.is_draining() is False and admin.reads == 1  # fresh: no reading
        clock.now += 0.5
        # Older than the period: this request waits for the new reading and is refused.
        assert await gate.is_draining() is True and admin.reads == 2

    asyncio.run(run())


def test_within_the_period_a_request_never_waits_and_the_reading_is_renewed_behind_it(clock):
    admin = Admin(latency_s=0.05)
    gate = DrainGate(admin.read, period_s=0.5, prefetch_s=0.25, clock=clock)

    async def run():
        await gate.is_draining()
        admin.flag = True
        clock.now += 0.3  # past the prefetch age, within the period
        loop = asyncio.get_running_loop()
        started = loop.time()
        answers = [await gate.is_draining() for _ in range(5)]
        assert loop.time() - started < admin.latency_s  # none of them waited for the admin
        assert answers == [False] * 5  # the reading they may use (0.3 s old) stands
        await asyncio.sleep(admin.latency_s * 2)
        assert admin.reads == 2  # one refresh for all five
        assert await gate.is_draining() is True  # the renewed reading
        assert admin.reads == 2

    asyncio.run(run())


def test_a_cancelled_request_leaves_the_reading_to_the_others(clock):
    admin = Admin(latency_s=0.05)
    gate = DrainGate(admin.read, period_s=0.5, prefetch_s=0.25, clock=clock)

    async def run():
        admin.flag = True
        first = asyncio.create_task(gate.is_draining())
        second = asyncio.create_task(gate.is_draining())
        await asyncio.sleep(0.01)
        first.cancel()
        assert await second is True
        with pytest.raises(asyncio.CancelledError):
            await first
        assert admin.reads == 1

    asyncio.run(run())


def test_an_admin_that_does_not_answer_leaves_the_last_reading_for_a_period(clock):
    admin = Admin(latency_s=0.001)
    gate = DrainGate(admin.read, period_s=0.5, prefetch_s=0.25, timeout_s=0.5, clock=clock)

    async def run():
        admin.flag = True
        assert await gate.is_draining() is True
        admin.flag, admin.fail = False, True
        clock.now += 1
        assert await gate.is_draining() is True  # it failed: the last answer stands
        clock.now += 0.1
        assert await gate.is_draining() is True and admin.reads == 2  # not asked again yet
        admin.fail = False
        clock.now += 0.5
        assert await gate.is_draining() is False and admin.reads == 3

    asyncio.run(run())
