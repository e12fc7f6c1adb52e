from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    # Set on CPU by `actors.layers.fused.use_fused_ops`: one pass of the engine's kernel.
    fused = False

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With `residual`, returns (norm(x + residual), x + residual) like fused kernels do;
        the fused path computes them in the storage of `x` and `residual`."""
        if self.fused:
            if residual is None:
                return torch.ops.serve_app.rms_norm(x, self.weight, self.eps)
            torch.ops.serve_app.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
