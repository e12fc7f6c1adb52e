"""Per-request output windows in the engine: a reader that falls behind is held (not
scheduled, KV kept) while others stream on; a hold past its deadline ends as `slow_consumer`;
a consumer that leaves is cancelled within one step; attempts are fenced."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from actors import LLM, SamplingParams
from actors.async_engine import AsyncEngine
from actors.request import FinishReason
from tests.support.async_engines import run_with_engine

LONG = SamplingParams(max_tokens=120, ignore_eos=True, temperature=0.0)
PROMPT = list(range(5, 40))


@pytest.fixture(scope="module")
def llm(model_dirs):
    llm = LLM(model=str(model_dirs("llama")))
    yield llm
    llm.shutdown()


async def collect(gen, outs: list, stop_after: int | None = None) -> None:
    """Read to the end, or leave (closing the stream, as a disconnect does) after some."""
    async for out in gen:
        outs.append(out)
        if stop_after is not None and len(outs) >= stop_after:
            await gen.aclose()
            return


async def read(gen, outs: list, count: int) -> None:
    """Read `count` outputs and stop reading, keeping the stream open."""
    for _ in range(count):
        outs.append(await gen.__anext__())


def token_ids(outs) -> list[int]:
    return [t for o in outs for d in o.deltas for t in d.token_ids]


async def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_a_stalled_reader_is_held_while_others_stream_then_resumes_unchanged(llm):
    reference = token_ids_of_full_run(llm)

    async def scenario(engine: AsyncEngine) -> None:
        stalled = engine.generate("stalled", PROMPT, LONG)
        first: list = []
        await read(stalled, first, 1)
        others = [[] for _ in range(3)]
        await asyncio.gather(
            *(collect(engine.generate(f"o{i}", PROMPT, LONG), others[i]) for i in range(3))
        )
        stats = engine.stats()
        # The others finished all their tokens while the stalled one sat held.
        assert all(len(token_ids(o)) == 120 for o in others)
        assert stats["held"] == 1 and stats["live_requests"] == 1
        assert stats["kv_blocks_used"] > 0
        rest: list = []
        await collect(stalled, rest)
        assert token_ids(first + rest) == reference
        assert rest[-1].deltas[-1].finish_reason is FinishReason.LENGTH
        await wait_for(lambda: engine.stats()["live_requests"] == 0)

    run_with_engine(llm, scenario, output_queue_size=4, hold_timeout_s=60)


def test_a_paused_reader_is_held_at_once_hands_out_nothing_and_resumes_unchanged(llm):
    """What the proxy's flow signal does: hold before the window fills, deliver nothing
    until the reader's transport takes outputs again."""
    reference = token_ids_of_full_run(llm)

    async def scenario(engine: AsyncEngine) -> None:
        gen = engine.generate("paused", PROMPT, LONG)
        first: list = []
        await read(gen, first, 1)
        engine.pause_reader("paused", True)
        await wait_for(lambda: engine.stats()["held"] == 1, timeout_s=1.0)
        pending = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.3)
        assert not pending.done()
        # Held well before its 64-output window: at most the step in flight landed.
        blocks = engine.stats()["kv_blocks_used"]
        await asyncio.sleep(0.2)
        assert engine.stats()["kv_blocks_used"] == blocks
        engine.pause_reader("paused", False)
        rest = [await pending]
        await collect(gen, rest)
        assert token_ids(first + rest) == reference
        await wait_for(lambda: engine.stats()["live_requests"] == 0)

    run_with_engine(llm, scenario, output_queue_size=64, hold_timeout_s=60)


def test_the_window_holds_while_the_event_loop_lags_then_streams_on_unchanged(llm):
    """The step thread counts what it posted against what the reader took: an event loop
    that stalls (a busy replica) does not let a request run past its window meanwhile."""
    reference = token_ids_of_full_run(llm)

    async def scenario(engine: AsyncEngine) -> None:
        gen = engine.generate("lagging", PROMPT, LONG)
        outs: list = []
        await read(gen, outs, 1)
        # The loop stalls for far longer than the 120 steps the request needs.
        time.sleep(1.0)
        await wait_for(lambda: engine.stats()["held"] == 1)
        # The step thread holds before it posts the output that filled the window: wait for
        # the window to arrive (a loaded machine may take a while), then for anything more.
        # It counts what the reader had taken when it posted: on a loaded machine it can post
        # the 4th output before the loop hands the reader its 1st, and then holds with 3
        # waiting once the reader has that one. Never more than the window.
        await wait_for(lambda: engine.stats()["unread_outputs"] >= 3)
        await asyncio.sleep(0.3)
        unread = engine.stats()["unread_outputs"]
        assert unread in (3, 4), unread  # nothing ran past the window
        await collect(gen, outs)
        assert token_ids(outs) == reference
        assert outs[-1].deltas[-1].finish_reason is FinishReason.LENGTH
        await wait_for(lambda: engine.stats()["live_requests"] == 0)

    run_with_engine(llm, scenario, output_queue_size=4, hold_timeout_s=60)


def token_ids_of_full_run(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], LONG)[0].outputs[0].token_ids


def test_a_hold_past_its_deadline_ends_as_slow_consumer_and_frees_its_blocks(llm):
    async def scenario(engine: AsyncEngine) -> None:
        baseline = engine.stats()["kv_blocks_used"]
        gen = engine.generate("slow", PROMPT, LONG)
        outs: list = []
        await read(gen, outs, 1)
        await wait_for(lambda: engine.stats()["slow_consumer_cancels"] == 1)
        await wait_for(lambda: engine.stats()["live_requests"] == 0)
        stats = engine.stats()
        assert stats["kv_blocks_used"] == baseline and stats["held"] == 0
        await collect(gen, outs)
        last = outs[-1].deltas[-1]
        assert last.finish_reason is FinishReason.ABORT
        assert last.stop_reason == "slow_consumer"
        # It never ran past its window: held at 4 unread outputs (+1 step in flight).
        assert len(token_ids(outs)) <= 1 + 4 + 1

    run_with_engine(llm, scenario, output_queue_size=4, hold_timeout_s=0.3)


def test_a_consumer_that_leaves_is_cancelled_within_one_step(llm):
    async def scenario(engine: AsyncEngine) -> None:
        rng = random.Random(0)
        baseline = engine.stats()["kv_blocks_used"]
        stops = [rng.randint(1, 30) for _ in range(12)]
        outs = [[] for _ in stops]
        await asyncio.gather(
            *(
                collect(engine.generate(f"c{i}", PROMPT, LONG), outs[i], stop_after=k)
                for i, k in enumerate(stops)
            )
        )
        await wait_for(lambda: engine.stats()["live_requests"] == 0)
        stats = engine.stats()
        # Each consumer left with the engine at most one step ahead of it.
        assert stats["outputs_after_cancel"] <= len(stops)
        assert stats["outputs_after_cancel"] <= stats["fenced_outputs"]
        assert stats["kv_blocks_used"] == baseline
        assert stats["running"] == stats["waiting"] == stats["held"] == 0

    run_with_engine(llm, scenario)


def test_outputs_queued_to_a_busy_loop_are_fenced_but_not_counted_as_after_the_cancel(llm):
    async def scenario(engine: AsyncEngine) -> None:
        gen = engine.generate("lagged", PROMPT, LONG)
        await read(gen, [], 1)
        begun = engine._steps_begun
        # The event loop is busy elsewhere: the step thread's outputs wait in its queue.
        time.sleep(0.3)
        queued = engine._steps_begun - begun
        await gen.aclose()  # the consumer leaves before the loop hands any of them out
        await wait_for(lambda: engine.stats()["live_requests"] == 0)
        stats = engine.stats()
        # Every output computed while the loop was busy is dropped by the fence ...
        assert stats["fenced_outputs"] >= queued - 1 >= 3
        # ... but the engine itself ran at most one step after the cancel.
        assert stats["outputs_after_cancel"] <= 1

    run_with_engine(llm, scenario, step_delay_s=0.02)


def test_a_new_attempt_never_sees_the_closed_attempts_outputs(llm):
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=7)
    fresh = llm.generate([PROMPT], params)[0].outputs[0].token_ids

    async def scenario(engine: AsyncEngine) -> None:
        first: list = []
        await collect(engine.generate("same", PROMPT, params, attempt=0), first, 3)
        second: list = []
        await collect(engine.generate("same", PROMPT, params, attempt=1), second)
        assert all(o.attempt == 1 and o.request_id == "same" for o in second)
        assert token_ids(second) == fresh

    run_with_engine(llm, scenario)


def test_a_live_id_refuses_a_second_attempt(llm):
    async def scenario(engine: AsyncEngine) -> None:
        gen = engine.generate("busy", PROMPT, LONG)
        await read(gen, [], 1)
        with pytest.raises(ValueError, match="already running"):
            await collect(engine.generate("busy", PROMPT, LONG, attempt=1), [])
        await gen.aclose()

    run_with_engine(llm, scenario)
