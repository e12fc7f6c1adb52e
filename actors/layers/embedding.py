"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from actors.layers.linear import LazySlice, _copy
from actors.layers.prepack import linear
from actors.parallel_state import get_tp_group

VOCAB_PADDING = 64


def pad_vocab(vocab_size: int, tp_size: int) -> int:
    multiple = VOCAB_PADDING * tp_size
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.vocab_size = vocab_size
        self.padded_vocab_size = pad_vocab(vocab_size, tp.world_size)
        self.num_per_rank = self.padded_vocab_size // tp.world_size
        self.vocab_start = self.tp_rank * self.num_per_rank
        self.weight = nn.Parameter(torch.zeros(self.num_per_rank, hidden_size))
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: LazySlice, shard_id: Any = None) -> None:
        total = loaded.get_shape()[0]
        start = self.vocab_start
        end = min(start + self.num_per_rank, total)
        if end > start:
            # Rows past the real vocab stay zero (padding).
            _copy(param.data[: end - start], loaded[start:end], "vocab shard")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return get_tp_group().all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocab: local matmul, then the shards gathered on every rank."""

    packed_weight: torch.Tensor | None = None  # see ColumnParallelLinear
    panel_weight: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        # (num_tokens, vocab_per_rank) -> (num_tokens, vocab_size)
        logits = linear(hidden, self.weight, packed=self.packed_weight, panels=self.panel_weight)
        logits = get_tp_group().all_gather_last_dim(logits)
        return logits[:, : self.vocab_size]
