"""Rotary position embeddings (neox-style halves), with the rope_scaling types HF configs use."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

# Keys of `rope_parameters` each scaling computed here needs; a config that lacks one (or asks
# for a partial rotary factor) takes transformers' definitions, which fill defaults in.
_OWN_SCALINGS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def inv_freq_and_scale(
    model_path: str, head_dim: int, rope_parameters: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    rope_type = rope_parameters.get("rope_type", "default")
    theta = float(rope_parameters.get("rope_theta", 10000.0))
    if rope_type == "default":
        return _default_inv_freq(theta, head_dim), 1.0
    if rope_type == "dynamic":
        # NOTE: dynamic NTK rescales with the current length, which breaks cached keys.
        raise ValueError("rope_scaling type 'dynamic' is not supported with a KV cache")
    needs = _OWN_SCALINGS.get(rope_type)
    if (
        needs is not None
        and all(key in rope_parameters for key in needs)
        and rope_parameters.get("partial_rotary_factor", 1.0) == 1.0
    ):
        # Llama 3's and linear scaling, here: transformers' config classes cost a new process
        # about 2.5 s of imports, paid by every engine replica, rank and batch actor.
        inv_freq = _default_inv_freq(theta, head_dim)
        if rope_type == "linear":
            return inv_freq / rope_parameters["factor"], 1.0
        return _llama3_inv_freq(inv_freq, rope_parameters), 1.0
    # Other scaled variants (yarn, longrope, ...): transformers' own definitions.
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported")
    hf_config = AutoConfig.from_pretrained(model_path)
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


def _default_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponent)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency scaling: wavelengths longer than the original context divided
    by `factor`, shorter than its `high_freq_factor`-th part kept, and a smooth blend
    between."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    # Set on CPU by `actors.layers.fused.use_fused_ops`: q and k rotated in place.
    fused = False

    def __init__(self, head_dim: int, max_position: int, inv_freq: torch.Tensor, scale: float):
        super().__init__()
        positions = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
        freqs = torch.outer(positions, inv_freq)  # (max_position, head_dim / 2)
        self.register_buffer("cos", (freqs.cos() * scale), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scale), persistent=False)
        # Every layer of a step rotates at the same positions: look them up once per step.
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: (num_tokens, num_heads, head_dim); k: (num_tokens, num_kv_heads, head_dim)
        if self.fused:
            torch.ops.serve_app.rotary_embedding(positions, q, k, self.cos, self.sin)
            return q, k
        rows = self._rows
        # NOTE: `is`, not equality: the step's one positions tensor, kept alive by the cache
        # itself, so a later step's tensor can never pass for it.
        if rows is None or rows[0] is not positions:
            rows = (positions, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))
            self._rows = rows
        _, cos, sin = rows
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
