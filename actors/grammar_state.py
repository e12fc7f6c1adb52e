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


def _allows(row, token: int) -> bool:
    return token >= 0 and bool((int(row[token >> 5]) >> (token & 31)) & 1)


class GrammarConstraint:
    # Rollback depth: a speculative fill advances a matcher by at most the draft's length and
    # rolls it back before the step samples (xgrammar keeps that history per matcher).
    def __init__(self, compiled: xgr.CompiledGrammar, max_rollback_tokens: int = -1):
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
    xgrammar call per position (it releases the GIL, so the forward's Python keeps running),
    into one buffer allocated at start-up for every row a step can have. Counts what it did:
    `stats()` gives steps, rows and seconds spent filling.

    A sequence verifying a draft gets one row per position: row j holds the legal tokens after
    its first j proposed tokens. Each proposed token advances its matcher provisionally (a token
    illegal at position j stops it there: later rows are never committed), and the matcher is
    rolled back before the fill returns, so only `accept` of committed tokens moves it for good.
    """

    def __init__(self, vocab_size: int, max_rows: int):
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        # Lazily started; its thread exits when the filler is collected or closed.
        self._pool = ThreadPoolExecutor(
            1,
            thread_name_prefix="grammar-masks",
            initializer=name_os_thread,
            initargs=(ENGINE_THREAD_PREFIX + "masks",),
        )
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self.buffer = xgr.allocate_token_bitmask(max_rows, vocab_size)
        self.num_steps = 0
        self.num_rows = 0
        self.fill_seconds = 0.0

    def start(
        self, constraints: list[GrammarConstraint | None], drafts: list[list[int]] | None = None
    ) -> Future[GrammarMasks] | None:
        """Begin filling the masks of the step's sampled items (`constraints[i]` for sampled
        item i, None where unconstrained; `drafts[i]` its proposed tokens). None when no row is
        constrained."""
        drafts = drafts or [[] for _ in constraints]
        first_row, n = [], 0
        for draft in drafts:
            first_row.append(n)
            n += 1 + len(draft)
        if n > self.max_rows:
            raise ValueError(
                f"a step of {n} sampled rows exceeds the mask buffer's {self.max_rows}"
            )
        work = [(c, first_row[i], drafts[i]) for i, c in enumerate(constraints) if c is not None]
        if not work:
            return None
        return self._pool.submit(self._fill, work, n)

    def _fill(self, work: list[tuple[GrammarConstraint, int, list[int]]], n: int) -> GrammarMasks:
        started = time.perf_counter()
        bitmask = self.buffer[:n]
        rows: list[int] = []
        advanced = [0] * len(work)
        live = list(range(len(work)))
        position = 0
        while live:
            matchers = [work[w][0].matcher for w in live]
            at = [work[w][1] + position for w in live]
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, at)
            rows.extend(at)
            still = []
            for w, row in zip(live, at, strict=True):
                constraint, _, draft = work[w]
                if position >= len(draft):
                    continue
                token = draft[position]
                # Provisional: a token this row forbids ends the draft's masks here.
                if _allows(bitmask[row], token) and constraint.matcher.accept_token(token):
                    advanced[w] += 1
                    # A draft that runs past the grammar's end (its stop token accepted)
                    # has no mask after it: a verified stop token ends the sequence.
                    if not constraint.matcher.is_terminated():
                        still.append(w)
            live = still
            position += 1
        for (constraint, _, _), count in zip(work, advanced, strict=True):
            if count:
                constraint.matcher.rollback(count)
        self.fill_seconds += time.perf_counter() - started
        self.num_steps += 1
        self.num_rows += len(rows)
        return GrammarMasks(bitmask, sorted(rows))

    def stats(self) -> dict[str, float]:
        return {
            "mask_fill_steps": self.num_steps,
            "mask_fill_rows": self.num_rows,
            "mask_fill_seconds": self.fill_seconds,
        }

    def close(self) -> None:
        self._pool.shutdown(wait=True)
