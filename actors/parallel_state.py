"""Process-wide tensor-parallel state behind one accessor (raises when unset or set twice)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int
    world_size: int
    # None when world_size == 1: collectives are no-ops.
    group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's shard along the last dim (vocab-parallel logits)."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


_TP: TPGroup | None = None


def set_tp_group(group: TPGroup) -> None:
    global _TP
    if _TP is not None:
        raise RuntimeError("tensor-parallel group is already set in this process")
    _TP = group


def get_tp_group() -> TPGroup:
    if _TP is None:
        raise RuntimeError("tensor-parallel group is not set; call set_tp_group first")
    return _TP


def ensure_single_rank_group() -> None:
    """For in-process TP=1 use: set a trivial group unless one is already set."""
    if _TP is None:
        set_tp_group(TPGroup(rank=0, world_size=1))
