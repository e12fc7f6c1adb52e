"""The executor seam: how the engine core reaches its ranks.

Invariant: `execute` runs one step on every rank with the same StepInput and returns rank 0's
StepOutput; any rank failure raises `ExecutorError` (never hangs) and marks it unhealthy.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from actors.config import CacheConfig, ModelConfig, ParallelConfig, check_tensor_parallel
from actors.messages import StepInput, StepOutput


class ExecutorError(RuntimeError):
    """A rank failed or vanished; in-flight requests cannot continue on this executor."""


class Executor(abc.ABC):
    @abc.abstractmethod
    def determine_num_blocks(self) -> int: ...

    @abc.abstractmethod
    def init_kv_cache(self, num_blocks: int) -> None: ...

    @abc.abstractmethod
    def execute(self, step: StepInput) -> StepOutput: ...

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


class InProcessExecutor(Executor):
    """TP=1 in the caller's process: no Ray, no serialisation."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, seed: int = 0):
        from actors.worker import Worker

        self.worker = Worker(model_config, cache_config, seed=seed)
        self._healthy = True

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)

    def execute(self, step: StepInput) -> StepOutput:
        try:
            out = self.worker.execute(step)
        except Exception as exc:
            self._healthy = False
            raise ExecutorError(f"step failed: {exc}") from exc
        assert out is not None
        return out

    def is_healthy(self) -> bool:
        return self._healthy

    def shutdown(self) -> None:
        self.worker.shutdown()

    def shard_info(self) -> list[dict[str, object]]:
        return [self.worker.shard_info()]


def make_executor(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    parallel_config: ParallelConfig,
    seed: int = 0,
) -> Executor:
    check_tensor_parallel(model_config, parallel_config.tensor_parallel_size)
    if parallel_config.tensor_parallel_size == 1:
        return InProcessExecutor(model_config, cache_config, seed)
    from actors.ray_executor import RayExecutor

    return RayExecutor(model_config, cache_config, parallel_config, seed)
