"""An `AsyncEngine` over a test module's shared `LLM`, and the shared core left clean after."""

from __future__ import annotations

import asyncio

from actors import LLM
from actors.async_engine import AsyncEngine


def make_engine(llm: LLM, **kwargs) -> AsyncEngine:
    engine = AsyncEngine(llm.engine, None, **kwargs)
    # The step thread belongs to this engine; the LLM's executor outlives it.
    engine.core.shutdown = lambda: None  # type: ignore[method-assign]
    return engine


def settle(llm: LLM) -> None:
    """End whatever a scenario left in the shared core (a request held, with its hold timer
    gone with the loop), or every later test's offline generate steps on behind it."""
    llm.engine.step_delay_s = 0.0
    for request_id in list(llm.engine.requests):
        llm.engine.abort(request_id)
    while llm.engine.has_unfinished():
        llm.engine.step()


def run_with_engine(llm: LLM, scenario, step_delay_s: float = 0.0, **kwargs) -> None:
    """`await scenario(engine)` on a fresh AsyncEngine over the shared LLM, shut down after;
    `step_delay_s` slows the shared core's steps for this scenario only."""

    async def main() -> None:
        engine = make_engine(llm, **kwargs)
        try:
            await scenario(engine)
        finally:
            engine.shutdown()

    llm.engine.step_delay_s = step_delay_s
    try:
        asyncio.run(main())
    finally:
        settle(llm)
