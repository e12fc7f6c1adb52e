"""How the engine core reaches its ranks: `make_executor` picks the executor for a
`ParallelConfig` (in-process at TP=1, one Ray actor per rank above, `ray_tp`).

- `base`: the `Executor` seam and `ExecutorError`;
- `in_process`: TP=1 in the caller's process;
- `ray_tp`: TP ranks as Ray actors in a placement group (NCCL on GPUs, gloo on CPU);
- `worker`: one rank: its model shard, KV cache and step.
"""

from __future__ import annotations

from actors.config import CacheConfig, ModelConfig, ParallelConfig, check_tensor_parallel
from actors.executor.base import Executor, ExecutorError
from actors.spec_decode.config import SpeculativeConfig


def ranks_on_gpu(parallel_config: ParallelConfig) -> bool:
    """Whether the executor `make_executor` picks runs its ranks on GPUs: at TP=1 this
    process's device, above it the rank bundles' (`ray_tp.bundles_use_gpu`)."""
    if parallel_config.tensor_parallel_size == 1:
        from actors.platform import is_cuda

        return is_cuda()
    from actors.executor.ray_tp import bundles_use_gpu

    return bundles_use_gpu(parallel_config.use_gpu)


def make_executor(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    parallel_config: ParallelConfig,
    seed: int = 0,
    speculative_config: SpeculativeConfig | None = None,
) -> Executor:
    check_tensor_parallel(model_config, parallel_config.tensor_parallel_size)
    if speculative_config is not None and speculative_config.method == "draft_model":
        from actors.spec_decode.draft import draft_model_config

        draft = draft_model_config(speculative_config, model_config)
        check_tensor_parallel(draft, parallel_config.tensor_parallel_size)
    if parallel_config.tensor_parallel_size == 1:
        from actors.executor.in_process import InProcessExecutor

        return InProcessExecutor(model_config, cache_config, seed, speculative_config)
    from actors.executor.ray_tp import RayExecutor

    return RayExecutor(model_config, cache_config, parallel_config, seed, speculative_config)


__all__ = ["Executor", "ExecutorError", "make_executor", "ranks_on_gpu"]
