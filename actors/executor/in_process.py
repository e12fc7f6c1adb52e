"""TP=1: the engine's one rank in the caller's process."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from actors.config import CacheConfig, ModelConfig
from actors.executor.base import Executor, ExecutorError, wait_for_masks
from actors.messages import GrammarMasks, StepInput, StepOutput
from actors.spec_decode.config import SpeculativeConfig
from actors.spec_decode.draft import DraftRequest

T = TypeVar("T")


class InProcessExecutor(Executor):
    """TP=1 in the caller's process: no Ray, no serialisation."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        seed: int = 0,
        speculative_config: SpeculativeConfig | None = None,
    ):
        from actors.executor.worker import Worker

        self.worker = Worker(
            model_config, cache_config, seed=seed, speculative_config=speculative_config
        )
        self._healthy = True

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)

    def register_vocab_mask_buffer(self, num_rows: int) -> tuple[int, ...]:
        return self.worker.register_vocab_mask_buffer(num_rows)

    def execute(self, step: StepInput, masks: Future[GrammarMasks] | None = None) -> StepOutput:
        def step_once() -> StepOutput | None:
            try:
                self.worker.forward(step)
            finally:
                filled = wait_for_masks(masks)
            return self.worker.sample(filled)

        out = self._guarded("step", step_once)
        assert out is not None
        return out

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        drafts = self._guarded("drafting", lambda: self.worker.propose(requests))
        assert drafts is not None
        return drafts

    def _guarded(self, what: str, call: Callable[[], T]) -> T:
        """`call()`; a failure marks the executor unhealthy (the rank's state is unknown
        after it) and raises ExecutorError."""
        try:
            return call()
        except Exception as exc:
            self._healthy = False
            raise ExecutorError(f"{what} failed: {exc}") from exc

    def is_healthy(self) -> bool:
        return self._healthy

    def shutdown(self) -> None:
        self.worker.shutdown()

    def shard_info(self) -> list[dict[str, object]]:
        return [self.worker.shard_info()]
