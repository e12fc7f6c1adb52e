"""Tensor-parallel linear layers. Each owns a `weight_loader` that takes only its shard.

Loaders receive a lazy slice (safetensors `get_slice`) so a
rank never materialises the full tensor. Collectives appear explicitly in `forward`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from actors.layers.prepack import linear
from actors.parallel_state import get_tp_group


class LazySlice(Protocol):
    def get_shape(self) -> list[int]: ...
    def __getitem__(self, index: Any) -> torch.Tensor: ...


def _copy(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"{name}: expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
    param.data.copy_(loaded.to(param.dtype))


def default_weight_loader(param: torch.Tensor, loaded: LazySlice, shard_id: Any = None) -> None:
    """Replicated parameters (norms): every rank takes the whole tensor."""
    _copy(param, loaded[:], "replicated")


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"tensor_parallel_size ({denominator}) must divide {what} ({numerator})")
    return numerator // denominator


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W split by output rows; each rank yields its slice of y."""

    # Set by `prepack_linears` on CPU (then `weight` itself is the packed tensor), and in
    # fp32 the same weight in panels for calls of a few rows.
    packed_weight: torch.Tensor | None = None
    panel_weight: torch.Tensor | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool = False, what: str = ""):
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.output_size_per_rank = _divide(output_size, tp.world_size, what or "output size")
        self.weight = nn.Parameter(torch.empty(self.output_size_per_rank, input_size))
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_rank))
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: LazySlice, shard_id: Any = None) -> None:
        n = self.output_size_per_rank
        _copy(param, loaded[self.tp_rank * n : (self.tp_rank + 1) * n], "column-parallel")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight, self.panel_weight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (gate_proj + up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, what="intermediate size")

    def weight_loader(self, param: nn.Parameter, loaded: LazySlice, shard_id: Any = None) -> None:
        tp = self.tp_size
        size = self.output_sizes[shard_id] // tp
        offset = sum(self.output_sizes[:shard_id]) // tp
        part = loaded[self.tp_rank * size : (self.tp_rank + 1) * size]
        _copy(param.data.narrow(0, offset, size), part, f"merged shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection. KV heads split across ranks, replicated when fewer than ranks."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ):
        tp = get_tp_group().world_size
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "num_key_value_heads")
        else:
            _divide(tp, num_kv_heads, "tensor_parallel_size, as a multiple of num_key_value_heads")
            self.num_kv_heads = 1
        self.total_kv_heads = num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias, what="fused qkv size")

    def weight_loader(self, param: nn.Parameter, loaded: LazySlice, shard_id: Any = None) -> None:
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            offset, size, start = 0, q_size, self.tp_rank * q_size
        else:
            # With replication, rank r reads KV head r // (tp / total_kv_heads).
            replicas = max(1, self.tp_size // self.total_kv_heads)
            start = (self.tp_rank // replicas) * kv_size
            offset, size = (q_size if shard_id == "k" else q_size + kv_size), kv_size
        _copy(param.data.narrow(0, offset, size), loaded[start : start + size], f"qkv {shard_id}")


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by input columns; partial sums are all-reduced."""

    packed_weight: torch.Tensor | None = None  # see ColumnParallelLinear
    panel_weight: torch.Tensor | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool = False, what: str = ""):
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.input_size_per_rank = _divide(input_size, tp.world_size, what or "input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_rank))
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.bias_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: LazySlice, shard_id: Any = None) -> None:
        n = self.input_size_per_rank
        _copy(param, loaded[:, self.tp_rank * n : (self.tp_rank + 1) * n], "row-parallel")

    def bias_loader(self, param: nn.Parameter, loaded: LazySlice, shard_id: Any = None) -> None:
        _copy(param, loaded[:], "row-parallel bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, packed=self.packed_weight, panels=self.panel_weight)
        get_tp_group().all_reduce(y)
        return y if self.bias is None else y + self.bias
