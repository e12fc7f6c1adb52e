"""After each step the step thread gives the event loop the GIL until the loop has delivered
the step's outputs (`actors.async_engine.PUBLISH_WAIT_S`): a token leaves before the next
step's Python takes the GIL back, and a stalled loop never stalls the engine."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors import LLM, SamplingParams, async_engine
from actors.async_engine import AsyncEngine
from tests.support.async_engines import make_engine, run_with_engine, settle

PROMPT = list(range(5, 40))
# Without the handoff the share below was 0.03-0.08 on an idle machine, 0.2-0.53 beside two
# busy processes, and once 0.9 in CI (a step thread taken off its core right after posting
# lets the loop in first): how often the loop wins is up to the scheduler, so only the
# handoff's side is asserted.
DELIVERED_SHARE = 0.8


@pytest.fixture(scope="module")
def llm(model_dirs):
    llm = LLM(model=str(model_dirs("llama")))
    yield llm
    llm.shutdown()


def delivered_before_next_step(llm: LLM) -> float:
    """The share of one request's steps whose outputs the event loop delivered before the
    step thread began the next step."""
    seen: list[tuple[int, int]] = []

    async def scenario(engine: AsyncEngine) -> None:
        deliver = engine._deliver

        def recording(outputs, step, held=()):
            seen.append((step, engine._steps_begun))
            deliver(outputs, step, held)

        engine._deliver = recording  # type: ignore[method-assign]
        params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)
        outs = [out async for out in engine.generate("r", PROMPT, params)]
        assert outs[-1].finished

    run_with_engine(llm, scenario)
    assert len(seen) >= 40
    return sum(step == begun for step, begun in seen) / len(seen)


def test_a_steps_outputs_are_delivered_before_the_next_step_begins(llm):
    # The best of three requests: on a loaded machine the loop's thread may wait for a core
    # past the 1 ms bound for a whole request's steps (the next test gives it the time).
    shares = []
    for _ in range(3):
        shares.append(delivered_before_next_step(llm))
        if shares[-1] >= DELIVERED_SHARE:
            break
    assert max(shares) >= DELIVERED_SHARE, shares


def test_the_handoff_holds_on_a_loaded_machine_given_the_time(llm, monkeypatch):
    # The 1 ms bound is what a busy machine can cut short; given 50 ms, every step's outputs
    # are delivered first, whatever else runs.
    monkeypatch.setattr(async_engine, "PUBLISH_WAIT_S", 0.05)
    assert delivered_before_next_step(llm) == 1.0


def test_a_stalled_event_loop_does_not_stall_the_engine(llm):
    async def scenario(engine: AsyncEngine) -> None:
        params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)
        gen = engine.generate("r", PROMPT, params)
        await gen.__anext__()
        before = engine.core.num_steps
        time.sleep(0.5)  # the loop busy in one callback: it delivers nothing meanwhile
        # The step thread waited at most PUBLISH_WAIT_S a step, then stepped on (up to the
        # request's output window of 64 unread outputs).
        assert engine.core.num_steps - before >= 10
        await gen.aclose()

    run_with_engine(llm, scenario)


def test_an_event_loop_that_closes_mid_request_leaves_the_engine_running(llm):
    engine = make_engine(llm)
    params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)
    # Slow steps: the step in flight when the loop closes posts its outputs after the close.
    llm.engine.step_delay_s = 0.02
    try:

        async def leave_after_one():
            gen = engine.generate("left", PROMPT, params)
            await gen.__anext__()  # then the loop closes with the request still stepping

        asyncio.run(leave_after_one())
        time.sleep(0.2)  # steps posted to the closed loop meanwhile
        assert engine.is_healthy()

        async def read_all():
            short = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)
            return [out async for out in engine.generate("next", PROMPT, short)]

        assert asyncio.run(read_all())[-1].finished
    finally:
        engine.shutdown()
        settle(llm)
