"""The panel kernel for linear layers at a few rows, against oneDNN's packed inner product.

Two measurements in one process, in fp32 or (`--dtype bfloat16`, CPUs with AMX) bf16:

- `kernel`: the model's own projection shapes (QKV, O, gate-up, down), as many copies as make
  `--weight-mib` of distinct weights, so that each is read from memory as in a decode step
  (not from the last-level cache). Per row count, the best of `--reps` passes over them all
  through oneDNN's packed weights and through the panels: ms, GFLOP/s, GB/s of weights.
- `engine`: `LLM.generate` on the same requests with the panels on and off in turn (the rows
  threshold set to 0 and back between runs; everything else identical), ABAB... over
  `--rounds`: one sequence, 4, 16 and 64 sequences in steady decode, and the vLLM comparison's
  64 mixed requests. Each phase's median over the rounds; every run kept.

    python benchmarks/panel_linear.py --rounds 3 --out benchmarks/results/panel_linear.json
    python benchmarks/panel_linear.py --dtype bfloat16 \
        --out benchmarks/results/panel_linear_bf16.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import (  # noqa: E402
    Timer,
    ab_generate,
    kernel_bench_model,
    mixed_requests,
    run_header,
    write_json,
)

from actors import LLM, SamplingParams  # noqa: E402
from actors.config import ModelConfig  # noqa: E402
from actors.layers import prepack  # noqa: E402
from actors.platform import PANEL_LINEAR_MAX_ROWS, use_panel_linear  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# (name, sequences, prompt tokens, output tokens): decode phases at a fixed batch, then the
# vLLM comparison's mixed requests (benchmarks/vllm_peer.py).
PHASES = (
    ("decode_b1", 1, 128, 64),
    ("decode_b4", 4, 128, 64),
    ("decode_b16", 16, 16, 128),
    ("decode_b64", 64, 16, 128),
)


def projection_shapes(path: str) -> list[tuple[int, int]]:
    c = ModelConfig.from_pretrained(path, dtype=torch.float32)
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    return [
        (qkv, c.hidden_size),
        (c.hidden_size, c.num_heads * c.head_dim),
        (2 * c.intermediate_size, c.hidden_size),
        (c.hidden_size, c.intermediate_size),
    ]


def kernel(path: str, weight_mib: int, reps: int, dtype: torch.dtype) -> dict:
    shapes = projection_shapes(path)
    per_set = sum(n * k * dtype.itemsize for n, k in shapes)
    sets = max(1, weight_mib * 2**20 // per_set)
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(sets):
        for n, k in shapes:
            w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
            layers.append((torch.ops.mkldnn._reorder_linear_weight(w), prepack._panels(w), w))
    weight_bytes = sets * per_set

    def best(rows: int, panels: bool) -> float:
        xs = {k: torch.randn(rows, k, generator=g).to(dtype) for _, k in shapes}
        seconds = []
        for _ in range(reps):
            with Timer() as t:
                for packed, panel, w in layers:
                    if panels:
                        torch.ops.serve_app.panel_linear(xs[w.shape[1]], panel, w.shape[0])
                    else:
                        prepack.linear(xs[w.shape[1]], w, packed=packed)
            seconds.append(t.seconds)
        return min(seconds)

    out = []
    flops = 2 * sum(n * k for n, k in shapes) * sets
    for rows in ROWS:
        onednn, panels = best(rows, False), best(rows, True)
        out.append(
            {
                "rows": rows,
                "onednn_ms": round(onednn * 1e3, 2),
                "panels_ms": round(panels * 1e3, 2),
                "onednn_gflop_s": round(rows * flops / onednn / 1e9, 1),
                "panels_gflop_s": round(rows * flops / panels / 1e9, 1),
                "onednn_weight_gb_s": round(weight_bytes / onednn / 1e9, 1),
                "panels_weight_gb_s": round(weight_bytes / panels / 1e9, 1),
                "panels_speedup": round(onednn / panels, 3),
            }
        )
    return {"weight_mib": round(weight_bytes / 2**20), "projections": len(layers), "rows": out}


def engine(path: str, rounds: int, vocab: int, dtype: torch.dtype) -> dict:
    phases = {
        name: mixed_requests(n, vocab, (plen, plen), (out, out), seed=500 + i)
        for i, (name, n, plen, out) in enumerate(PHASES)
    }
    phases["mixed_64"] = mixed_requests(64, vocab)

    with LLM(
        model=path,
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=2048,
        kv_cache_bytes=2 * 1024**3,
        enable_prefix_caching=False,  # every run prefills its prompts
    ) as llm:
        assert any(getattr(m, "panel_weight", None) is not None for m in llm_modules(llm))
        llm.generate([p for p, _ in phases["decode_b4"]], SamplingParams(max_tokens=8))

        def switch(side: str) -> None:
            off = {**PANEL_LINEAR_MAX_ROWS, dtype: 0}
            prepack.PANEL_LINEAR_MAX_ROWS = PANEL_LINEAR_MAX_ROWS if side == "panels" else off

        try:
            out, same_tokens = ab_generate(
                llm,
                phases,
                rounds,
                ("panels", "onednn"),
                switch,
                lambda reqs: sum(m for _, m in reqs),
            )
        finally:
            prepack.PANEL_LINEAR_MAX_ROWS = PANEL_LINEAR_MAX_ROWS
    return {"phases": out, "greedy_tokens_identical": same_tokens}


def llm_modules(llm: LLM):
    return llm.engine.executor.worker.runner.model.modules()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--weight-mib", type=int, default=512)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model, config = kernel_bench_model(args.model, args.threads)
    dtype = getattr(torch, args.dtype)
    if not use_panel_linear(torch.device("cpu"), dtype):
        raise SystemExit(f"no panel kernel for {args.dtype} here (bf16 needs AMX)")
    result = run_header(model, args.dtype)
    result["panel_rows"] = f"<= {PANEL_LINEAR_MAX_ROWS[dtype]}"
    result["kernel"] = kernel(model.path, args.weight_mib, args.reps, dtype)
    if not args.skip_engine:
        result["rounds"] = args.rounds
        result["engine"] = engine(model.path, args.rounds, config.vocab_size, dtype)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
