"""Per-sequence grammar constraint over xgrammar, and the step's mask fill.

The engine core starts `MaskFiller.start` for a step's sampled rows before the step runs; the
masks fill on their own thread while the forward runs (they depend only on tokens already
accepted) and the sampler waits for them after the logits. `accept` runs after the step, when
no fill is in flight, so a matcher is never read and advanced at once. Sequences without a
constraint share the same step untouched.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from actors.messages import GrammarMasks
from actors.torch_thread import ENGINE_THREAD_PREFIX, name_os_thread


class GrammarConstraint:
    def __init__(self, compiled: xgr.CompiledGrammar, max_rollback_tokens: int = 0):
        self.matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=max_rollback_tokens)
        self.num_rejected = 0

    def accept(self, token_id: int) -> bool:
        ok = self.matcher.accept_token(token_id)
        if not ok:
            # Only reachable if the mask was not applied; counted so tests can prove it is not.
            self.num_rejected += 1
        return ok

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class MaskFiller:
    """Fills a step's masks on one background thread, all constrained rows in one batched
    xgrammar call (it releases the GIL, so the forward's Python keeps running). Counts what it
    did: `stats()` gives steps, rows and seconds spent filling."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        # Lazily started; its thread exits when the filler is collected or closed.
        self._pool = ThreadPoolExecutor(
            1,
            thread_name_prefix="grammar-masks",
            initializer=name_os_thread,
            initargs=(ENGINE_THREAD_PREFIX + "masks",),
        )
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self.num_steps = 0
        self.num_rows = 0
        self.fill_seconds = 0.0

    def start(self, constraints: list[GrammarConstraint | None]) -> Future[GrammarMasks] | None:
        """Begin filling the masks of the step's sampled rows (`constraints[i]` for sampled
        item i; None where unconstrained). None when no row is constrained."""
        rows = [i for i, c in enumerate(constraints) if c is not None]
        if not rows:
            return None
        matchers = [constraints[i].matcher for i in rows]  # type: ignore[union-attr]
        return self._pool.submit(self._fill, matchers, rows, len(constraints))

    def _fill(self, matchers: list[xgr.GrammarMatcher], rows: list[int], n: int) -> GrammarMasks:
        started = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(n, self.vocab_size)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        self.fill_seconds += time.perf_counter() - started
        self.num_steps += 1
        self.num_rows += len(rows)
        return GrammarMasks(bitmask, rows)

    def stats(self) -> dict[str, float]:
        return {
            "mask_fill_steps": self.num_steps,
            "mask_fill_rows": self.num_rows,
            "mask_fill_seconds": self.fill_seconds,
        }

    def close(self) -> None:
        self._pool.shutdown(wait=True)
