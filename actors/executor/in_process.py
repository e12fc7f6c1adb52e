"""TP=1: the engine's one rank in the caller's process."""

from __future__ import annotations

from concurrent.futures import Future

from actors.config import CacheConfig, ModelConfig
from actors.executor.base import Executor, ExecutorError, wait_for_masks
from actors.messages import GrammarMasks, StepInput, StepOutput
from actors.spec_decode.config import SpeculativeConfig
from actors.spec_decode.draft import DraftRequest


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
        try:
            try:
                self.worker.forward(step)
            finally:
                filled = wait_for_masks(masks)
            out = self.worker.sample(filled)
        except Exception as exc:
            self._healthy = False
            raise ExecutorError(f"step failed: {exc}") from exc
        assert out is not None
        return out

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        try:
            drafts = self.worker.propose(requests)
        except Exception as exc:
            self._healthy = False
            raise ExecutorError(f"drafting failed: {exc}") from exc
        assert drafts is not None
        return drafts

    def is_healthy(self) -> bool:
        return self._healthy

    def shutdown(self) -> None:
        self.worker.shutdown()

    def shard_info(self) -> list[dict[str, object]]:
        return [self.worker.shard_info()]
