"""Linear layers on CPU through oneDNN, with each weight reordered once at load.

`F.linear` on CPU calls a plain GEMM that re-reads the weight in its stored layout on every
call; at decode batch sizes that is the step's largest cost, and it reaches about a third of
the memory bandwidth. oneDNN's inner-product primitive with a weight already in its blocked
layout (the path torch's own CPU compiler takes) does the same products 1.8-3x faster at
batch 1-16 on the `bench` checkpoint (figures in the README). Packing happens once, after the
checkpoint is loaded; a weight that belongs to one linear layer is replaced by its packed
form (same logical shape, no second copy), a weight shared with the embedding (tied LM head)
keeps its dense form and gains a packed copy.

In fp32 (and bf16 on CPUs with AMX), each layer also gets its weight in 32-output
panels for the engine's own kernel (actors/csrc/panel_linear.cpp), which takes calls of up to
`PANEL_LINEAR_MAX_ROWS[dtype]` rows: at decode batch sizes a layer is a read of its weight,
and the kernel reads it front to back with the loads prefetched ahead, where oneDNN's inner
product leaves the core waiting on memory. That is a second copy of every linear weight (the
panels for small calls, oneDNN's layout for prefill); `SERVE_APP_CPU_PANEL_LINEAR=0` keeps
one.

Each packed form is checked against `F.linear` on a random input before it is used; any
failure (op missing from a torch build, a dtype the CPU cannot do) keeps the previous path
for the whole model and is logged once.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from actors.platform import PANEL_LINEAR_MAX_ROWS, use_panel_linear, use_prepacked_linear

logger = logging.getLogger(__name__)

# Relative error of a packed product against F.linear that still counts as the same layer.
_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    panels: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T (+ b): a few rows through the layer's panels, more through its packed
    weight, each where the layer has one."""
    if panels is not None and x.dim() == 2 and x.shape[0] <= PANEL_LINEAR_MAX_ROWS[x.dtype]:
        return torch.ops.serve_app.panel_linear(x, panels, weight.shape[0], bias)
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _check(weight: torch.Tensor, **packed_form: torch.Tensor) -> None:
    # Its own generator: loading a model must not move the global RNG.
    probe = torch.Generator().manual_seed(0)
    x = torch.randn(4, weight.shape[1], generator=probe, dtype=weight.dtype)
    want = F.linear(x, weight).float()
    got = linear(x, weight, **packed_form).float()
    error = ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
    if not error <= _TOLERANCE[weight.dtype]:
        raise RuntimeError(f"packed product differs from F.linear (relative error {error:.2e})")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    _check(weight, packed=packed)
    return packed


def _panels(weight: torch.Tensor) -> torch.Tensor:
    panels = torch.ops.serve_app.pack_panels(weight.detach())
    _check(weight, panels=panels)
    return panels


def prepack_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Packs every layer that has a `packed_weight` slot; returns how many (0: dense path).
    In fp32 each such layer also gets `panel_weight` where the platform allows it."""
    layers = [m for m in model.modules() if hasattr(m, "packed_weight")]
    if use_panel_linear(device, dtype):
        try:
            panels = [_panels(m.weight) for m in layers]
        except Exception as exc:  # noqa: BLE001 (oneDNN or the dense path still works)
            logger.warning("linear layers stay off the panel kernel: packing failed (%s)", exc)
        else:
            for layer, weight in zip(layers, panels, strict=True):
                layer.panel_weight = weight
    if not use_prepacked_linear(device) or dtype not in _TOLERANCE:
        return 0
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    try:
        packed = [_pack(m.weight) for m in layers]
    except Exception as exc:  # noqa: BLE001 (any failure keeps the dense path, which works)
        logger.warning("linear layers stay on F.linear: oneDNN packing failed (%s)", exc)
        return 0
    for layer, weight in zip(layers, packed, strict=True):
        if uses[id(layer.weight)] == 1:
            # The parameter becomes the packed tensor (same logical shape): no second copy.
            layer.weight = nn.Parameter(weight, requires_grad=False)
        # Tied: the embedding still reads the dense weight, the head the packed copy.
        layer.packed_weight = weight
    return len(layers)
