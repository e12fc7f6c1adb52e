"""Switches a built model's small ops onto the engine's fused CPU kernels.

RMSNorm (and its residual add), rotary embedding and SiLU-and-mul each run as one pass of
actors/csrc/fused_ops.cpp instead of the chain of torch ops their modules otherwise run (the
reference path, kept for CUDA and for `SERVE_APP_CPU_FUSED_OPS=0`).
"""

from __future__ import annotations

import torch
from torch import nn

from actors.platform import fused_cpu_ops

FUSABLE = ("RMSNorm", "RotaryEmbedding", "LlamaMLP")


def use_fused_ops(model: nn.Module, device: torch.device) -> int:
    """Turns on the fused path of every fusable module; returns how many (0: none here)."""
    if not fused_cpu_ops(device):
        return 0
    modules = [m for m in model.modules() if type(m).__name__ in FUSABLE]
    for module in modules:
        module.fused = True
    return len(modules)
