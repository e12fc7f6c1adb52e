"""The executor seam: how the engine core reaches its ranks.

Invariant: `execute` runs one step on every rank with the same StepInput and returns rank 0's
StepOutput; any rank failure raises `ExecutorError` (never hangs) and marks it unhealthy. The
step's grammar masks, when it has any, come as a future the engine core fills while the
forward runs: the executor waits for them only before sampling, and always before it returns.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from concurrent.futures import Future

from actors.messages import GrammarMasks, StepInput, StepOutput
from actors.spec_decode.draft import DraftRequest


class ExecutorError(RuntimeError):
    """A rank failed or vanished; in-flight requests cannot continue on this executor."""


class Executor(abc.ABC):
    @abc.abstractmethod
    def determine_num_blocks(self) -> int: ...

    @abc.abstractmethod
    def init_kv_cache(self, num_blocks: int) -> None: ...

    @abc.abstractmethod
    def register_vocab_mask_buffer(self, num_rows: int) -> tuple[int, ...]:
        """Every rank allocates its grammar-mask buffer (see actors/mask_buffer.py) and all
        must agree on its shape, which this returns; disagreement raises (no start)."""

    @abc.abstractmethod
    def execute(self, step: StepInput, masks: Future[GrammarMasks] | None = None) -> StepOutput: ...

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """A model proposer's drafts, drafted alike on every rank (rank 0's returned, and
        kept there for the step that verifies them)."""
        raise NotImplementedError(f"{type(self).__name__} has no model proposer")

    @abc.abstractmethod
    def is_healthy(self) -> bool: ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...

    def shard_info(self) -> list[dict[str, object]]:
        return []

    def releaser(self) -> Callable[[], None]:
        """A callable that frees what this executor holds outside the process (rank actors,
        placement groups), idempotent and holding no reference to the executor: a finalizer
        keeps it to release an owner dropped without `shutdown`. In-process memory needs none
        (it goes with the objects)."""
        return _release_nothing


def _release_nothing() -> None:
    return None


def wait_for_masks(masks: Future[GrammarMasks] | None) -> GrammarMasks | None:
    """The step's masks once filled (None when it has none). A fill that failed raises here,
    as the step's own failure."""
    return None if masks is None else masks.result()
