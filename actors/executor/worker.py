"""A tensor-parallel rank: joins the process group, holds its weight and KV shards, runs steps.

`Worker` is a plain class (used in-process for TP=1); `RayWorker` is the thin actor shell the
Ray executor starts, one per rank.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from actors.config import CacheConfig, ModelConfig
from actors.messages import GrammarMasks, StepInput, StepOutput
from actors.model_runner import ModelRunner
from actors.parallel_state import TPGroup, ensure_single_rank_group, set_tp_group
from actors.platform import describe, device_for_rank, distributed_backend
from actors.spec_decode.config import SpeculativeConfig
from actors.spec_decode.draft import DraftRequest

logger = logging.getLogger(__name__)


class Worker:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        rank: int = 0,
        world_size: int = 1,
        init_method: str | None = None,
        seed: int = 0,
        speculative_config: SpeculativeConfig | None = None,
    ):
        self.rank = rank
        self.world_size = world_size
        self.device = device_for_rank(0)
        if world_size == 1:
            ensure_single_rank_group()
        else:
            backend = distributed_backend()
            dist.init_process_group(
                backend, init_method=init_method, rank=rank, world_size=world_size
            )
            set_tp_group(TPGroup(rank=rank, world_size=world_size, group=dist.group.WORLD))
        logger.info("TP rank %d/%d on %s", rank, world_size, describe())
        self.runner = ModelRunner(model_config, cache_config, self.device, seed, speculative_config)

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)

    def register_vocab_mask_buffer(self, num_rows: int) -> tuple[int, ...]:
        return self.runner.register_vocab_mask_buffer(num_rows)

    def execute(self, step: StepInput) -> StepOutput | None:
        return self.runner.execute(step)

    def forward(self, step: StepInput) -> None:
        self.runner.forward(step)

    def sample(self, masks: GrammarMasks | None) -> StepOutput | None:
        return self.runner.sample(masks)

    def propose(self, requests: list[DraftRequest]) -> list[list[int]] | None:
        return self.runner.propose(requests)

    def shard_info(self) -> dict[str, object]:
        """Parameter shapes and bytes held by this rank (tests check the sharding)."""
        params = dict(self.runner.model.named_parameters())
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "shapes": {name: tuple(p.shape) for name, p in params.items()},
            "param_bytes": sum(p.numel() * p.element_size() for p in params.values()),
            "kv_cache_bytes": sum(
                k.numel() * k.element_size() * 2 for k, _ in self.runner.kv_caches
            ),
            "device": str(self.device),
        }

    def ping(self) -> bool:
        return True

    def shutdown(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


class RayWorkerShell:
    """What runs inside a Ray actor: started empty, then `init_worker` once the rendezvous
    address (chosen by rank 0 on its own node) is known to every rank."""

    def __init__(self, num_threads: int):
        torch.set_num_threads(max(1, num_threads))
        self.worker: Worker | None = None

    def rendezvous_address(self) -> str:
        import socket

        import ray.util

        host = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return f"tcp://{host}:{port}"

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def init_worker(self, *args, **kwargs) -> None:
        import ray

        gpu_ids = ray.get_gpu_ids()
        if gpu_ids and not torch.cuda.is_available():
            logger.warning(
                "Ray assigned GPU(s) %s but torch sees no CUDA device: running on CPU", gpu_ids
            )
        self.worker = Worker(*args, **kwargs)

    def determine_num_blocks(self) -> int:
        return self._w.determine_num_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self._w.init_kv_cache(num_blocks)

    def register_vocab_mask_buffer(self, num_rows: int) -> tuple[int, ...]:
        return self._w.register_vocab_mask_buffer(num_rows)

    def execute(self, step: StepInput) -> StepOutput | None:
        return self._w.execute(step)

    def forward(self, step: StepInput) -> None:
        self._w.forward(step)

    def sample(self, masks: GrammarMasks | None) -> StepOutput | None:
        return self._w.sample(masks)

    def propose(self, requests: list[DraftRequest]) -> list[list[int]] | None:
        return self._w.propose(requests)

    def shard_info(self) -> dict[str, object]:
        return {**self._w.shard_info(), "node_id": self.node_id()}

    def ping(self) -> bool:
        return True

    @property
    def _w(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("worker used before init_worker")
        return self.worker
