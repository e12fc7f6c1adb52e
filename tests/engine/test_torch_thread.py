"""All of an owner's torch work on one thread: the engine's core is built on its step thread
when given a factory, and a TorchThread runs every call on the same thread."""

from __future__ import annotations

import os
import threading

import pytest

from actors import LLM, SamplingParams
from actors.async_engine import AsyncEngine
from actors.torch_thread import TorchThread
from serve_app import ray_env


def test_torch_thread_runs_every_call_on_one_thread_and_raises_what_fn_raises():
    torch_thread = TorchThread("t")
    try:
        idents = {torch_thread.run(threading.get_ident) for _ in range(5)}
        assert len(idents) == 1 and threading.get_ident() not in idents
        assert torch_thread.run(lambda a, b=0: a + b, 2, b=3) == 5
        with pytest.raises(ZeroDivisionError):
            torch_thread.run(lambda: 1 / 0)
    finally:
        torch_thread.shutdown()


def test_the_engine_builds_its_core_on_the_step_thread(model_dirs):
    llm = LLM(model=str(model_dirs("llama")))
    built_on: list[str] = []

    def factory():
        built_on.append(threading.current_thread().name)
        return llm.engine

    engine = AsyncEngine(factory, None)
    engine.core.shutdown = lambda: None  # type: ignore[method-assign] (the LLM owns it)
    try:
        assert built_on == ["engine-step"]
        assert engine.core is llm.engine

        async def run():
            params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
            return [out async for out in engine.generate("r", [5, 6, 7], params)]

        import asyncio

        assert asyncio.run(run())[-1].finished
    finally:
        engine.shutdown()
        llm.shutdown()


def test_a_core_that_fails_to_build_fails_the_engine_constructor():
    def factory():
        raise ValueError("no room for the KV cache")

    with pytest.raises(ValueError, match="no room"):
        AsyncEngine(factory, None)


def test_step_threads_leave_the_batch_policy_their_process_inherited(model_dirs):
    # Ray's processes run SCHED_BATCH (serve_app/ray_env.py); the threads doing an engine's
    # torch work must not: they would lose their cores to every serving-path thread waking.
    llm = LLM(model=str(model_dirs("llama")))
    policies: list[int] = []

    def factory():
        policies.append(os.sched_getscheduler(0))
        return llm.engine

    with ray_env.batch_scheduled_children():  # this thread, and what it starts, on SCHED_BATCH
        assert os.sched_getscheduler(0) == os.SCHED_BATCH
        engine = AsyncEngine(factory, None)
        torch_thread = TorchThread("t")
        policies.append(torch_thread.run(os.sched_getscheduler, 0))
    engine.core.shutdown = lambda: None  # type: ignore[method-assign] (the LLM owns it)
    try:
        assert policies == [os.SCHED_OTHER, os.SCHED_OTHER]
    finally:
        torch_thread.shutdown()
        engine.shutdown()
        llm.shutdown()
