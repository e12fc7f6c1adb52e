"""torch.compile (inductor, CPU) of a decoder layer's MLP block against the engine's eager path.

The engine runs eager: oneDNN's packed GEMMs (the panel kernel at up to 128 rows) and its own
fused CPU ops (actors/csrc/fused_ops.cpp). This measures what inductor would give the same
block: residual add and RMSNorm, the gate/up projection, SiLU·mul, the down projection, at
the checkpoint's shapes, fp32, one compiled graph per row count (`dynamic=False`, weights
frozen as inductor's CPU path does for inference).

- `block`: per row count, the best of `--reps` calls through the engine's path, the compiled
  block and the same torch code eager; the compile's seconds; the largest difference of each
  from the eager torch block.
- `gemm`: the layer's four projections, summed, per row count: oneDNN's packed weight (the
  engine's), `F.linear`, and MKL's packed weight for exactly that row count (what inductor's
  frozen graph calls; MKL's pack is made for one row count, other counts fall back to
  `F.linear`), and, where the row count is a multiple of `MKL_CHUNK_ROWS`, those rows taken
  `MKL_CHUNK_ROWS` at a time through one pack made for that count (how one fixed pack could
  serve every prefill step; outputs joined as the engine would need them).

    python benchmarks/torch_compile.py --out benchmarks/results/torch_compile.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from common import Timer, best_of, kernel_bench_model, run_header, write_json  # noqa: E402

from actors.config import ModelConfig  # noqa: E402
from actors.layers import prepack  # noqa: E402

BLOCK_ROWS = (16, 64, 512, 2048)
GEMM_ROWS = (128, 256, 512, 1024, 2048)
MKL_CHUNK_ROWS = 256


def best_ms(fn, reps: int) -> float:
    return round(best_of(fn, reps) * 1e3, 3)


def on_copies(fn, x: torch.Tensor, residual: torch.Tensor):
    """A call of the block on fresh copies (the engine's fused norm works in place)."""
    return lambda: fn(x.clone(), residual.clone())


class PlainBlock(nn.Module):
    """The block as plain torch ops, for inductor to fuse as it will."""

    def __init__(self, norm_w, gate_up, down, eps: float):
        super().__init__()
        self.norm_w = nn.Parameter(norm_w, requires_grad=False)
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)
        self.down = nn.Parameter(down, requires_grad=False)
        self.eps = eps

    def forward(self, x, residual):
        residual = x + residual
        normed = residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + self.eps)
        gate, up = F.linear(normed * self.norm_w, self.gate_up).chunk(2, -1)
        return F.linear(F.silu(gate) * up, self.down), residual


def block(config: ModelConfig, reps: int) -> list[dict]:
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True  # weights as constants: inductor prepacks them
    hidden, inter, eps = config.hidden_size, config.intermediate_size, config.rms_norm_eps
    g = torch.Generator().manual_seed(0)
    norm_w = torch.rand(hidden, generator=g) + 0.5
    gate_up = torch.randn(2 * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(hidden, inter, generator=g) * inter**-0.5
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in (gate_up, down)]
    panels = [prepack._panels(w) for w in (gate_up, down)]

    def engine(x, residual):
        torch.ops.serve_app.fused_add_rms_norm(x, residual, norm_w, eps)
        h = prepack.linear(x, gate_up, packed=packed[0], panels=panels[0])
        a = torch.ops.serve_app.silu_and_mul(h)
        return prepack.linear(a, down, packed=packed[1], panels=panels[1])

    plain = PlainBlock(norm_w, gate_up, down, eps).eval()
    out = []
    with torch.no_grad():
        for rows in BLOCK_ROWS:
            x0 = torch.randn(rows, hidden, generator=g)
            r0 = torch.randn(rows, hidden, generator=g)
            compiled = torch.compile(plain, dynamic=False)
            with Timer() as t:
                got = compiled(x0, r0)[0]
            want = plain(x0, r0)[0]
            ours = engine(x0.clone(), r0.clone())
            n = reps if rows <= 64 else max(3, reps // 10)
            row = {
                "rows": rows,
                "engine_ms": best_ms(on_copies(engine, x0, r0), n),
                "compiled_ms": best_ms(on_copies(compiled, x0, r0), n),
                "eager_torch_ms": best_ms(on_copies(plain, x0, r0), n),
                "compile_s": round(t.seconds, 1),
                "engine_max_diff": (ours - want).abs().max().item(),
                "compiled_max_diff": (got - want).abs().max().item(),
            }
            row["compiled_over_engine"] = round(row["engine_ms"] / row["compiled_ms"], 3)
            out.append(row)
    return out


def gemm(config: ModelConfig, reps: int) -> list[dict]:
    c = config
    shapes = [
        ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
        (c.hidden_size, c.num_heads * c.head_dim),
        (2 * c.intermediate_size, c.hidden_size),
        (c.hidden_size, c.intermediate_size),
    ]
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(n, k, generator=g) * k**-0.5 for n, k in shapes]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    chunk_packs = [torch.ops.mkl._mkl_reorder_linear_weight(w, MKL_CHUNK_ROWS) for w in weights]

    def in_chunks(x: torch.Tensor, w: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        parts = x.split(MKL_CHUNK_ROWS)
        return torch.cat([torch.ops.mkl._mkl_linear(c, m, w, None, MKL_CHUNK_ROWS) for c in parts])

    out = []
    for rows in GEMM_ROWS:
        xs = [torch.randn(rows, w.shape[1], generator=g) for w in weights]
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
        n = max(3, reps // (rows // 128))
        ms = {"onednn_packed": 0.0, "f_linear": 0.0, "mkl_packed": 0.0}
        chunked = f"mkl_packed_{MKL_CHUNK_ROWS}_row_chunks" if rows % MKL_CHUNK_ROWS == 0 else None
        if chunked:
            ms[chunked] = 0.0
        for x, w, p, m, c in zip(xs, weights, onednn, mkl, chunk_packs, strict=True):
            ms["onednn_packed"] += best_ms(
                lambda x=x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), n
            )
            ms["f_linear"] += best_ms(lambda x=x, w=w: F.linear(x, w), n)
            ms["mkl_packed"] += best_ms(
                lambda x=x, w=w, m=m, b=rows: torch.ops.mkl._mkl_linear(x, m, w, None, b), n
            )
            if chunked:
                ms[chunked] += best_ms(lambda x=x, w=w, c=c: in_chunks(x, w, c), n)
        flops = 2 * rows * sum(n_ * k for n_, k in shapes)
        out.append(
            {
                "rows": rows,
                **{f"{k}_ms": round(v, 2) for k, v in ms.items()},
                **{f"{k}_gflop_s": round(flops / v / 1e6, 1) for k, v in ms.items()},
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model, config = kernel_bench_model(args.model, args.threads)
    result = run_header(model)
    result["torch"] = torch.__version__
    result["block"] = block(config, args.reps)
    result["gemm"] = gemm(config, args.reps)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
