"""The engine's prefill attention kernel against torch's fused SDPA, per layer and per prefill.

Two measurements, both fp32 and in one process:

- `kernel`: one layer's causal attention at the checkpoint's head shape (query heads, KV
  heads, head dim) for one sequence of 64-512 tokens, and a 100-token chunk after 612 cached
  ones; the best of `--reps` calls each through `torch.ops.serve_app.prefill_attention` and
  through `scaled_dot_product_attention` on batched inputs (torch's fused CPU kernel, the
  engine's fallback): ms and GFLOP/s (the causal products only, QK and PV).
- `engine`: whole prefills through `LLM.generate` (one output token each) with the kernel on
  and off in turn on the same engine (ABAB... over `--rounds`); prompt tokens/s, each phase's
  median, every run kept.

    python benchmarks/prefill_attention.py --out benchmarks/results/prefill_attention.json
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import (  # noqa: E402
    ab_generate,
    best_of,
    exact_params,
    kernel_bench_model,
    mixed_requests,
    run_header,
    write_json,
)

from actors import LLM  # noqa: E402
from actors.config import ModelConfig  # noqa: E402

# (tokens of this chunk, tokens in context including them)
CHUNKS = ((64, 64), (160, 160), (256, 256), (512, 512), (100, 712))
# (name, prompts, prompt tokens)
PHASES = (("prefill_16x256", 16, 256), ("prefill_4x512", 4, 512))


def causal_flops(heads: int, d: int, q_len: int, ctx: int) -> int:
    """QK and PV over each query row's causal prefix (ctx - q_len + i + 1 keys for row i)."""
    seen = q_len * (ctx - q_len) + q_len * (q_len + 1) // 2
    return 2 * 2 * heads * d * seen


def sdpa(q, k, v, mask, scale: float, gqa: bool) -> torch.Tensor:
    """The engine's fallback: torch's fused kernel, reached with batched (4-D) inputs."""
    return F.scaled_dot_product_attention(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=gqa,
    )


def kernel(config: ModelConfig, reps: int) -> list[dict]:
    heads, kv_heads, d = config.num_heads, config.num_kv_heads, config.head_dim
    scale = d**-0.5
    g = torch.Generator().manual_seed(0)
    out = []
    for q_len, ctx in CHUNKS:
        # The engine's views: the projection's output seen per head, (heads, tokens, d).
        q = torch.randn(q_len, heads, d, generator=g).transpose(0, 1)
        k = torch.randn(ctx, kv_heads, d, generator=g).transpose(0, 1)
        v = torch.randn(ctx, kv_heads, d, generator=g).transpose(0, 1)
        # A chunk after cached tokens needs the mask (the engine's fallback passes one).
        mask = None if q_len == ctx else torch.ones(q_len, ctx, dtype=torch.bool).tril(ctx - q_len)
        calls = {
            "kernel": partial(torch.ops.serve_app.prefill_attention, q, k, v, scale),
            "sdpa": partial(sdpa, q, k, v, mask, scale, heads != kv_heads),
        }
        best = {name: best_of(fn, reps) for name, fn in calls.items()}
        flops = causal_flops(heads, d, q_len, ctx)
        out.append(
            {
                "q_len": q_len,
                "ctx": ctx,
                "kernel_ms": round(best["kernel"] * 1e3, 3),
                "sdpa_ms": round(best["sdpa"] * 1e3, 3),
                "kernel_gflop_s": round(flops / best["kernel"] / 1e9, 1),
                "sdpa_gflop_s": round(flops / best["sdpa"] / 1e9, 1),
                "speedup": round(best["sdpa"] / best["kernel"], 2),
            }
        )
    return out


def attention_backend(llm: LLM):
    """The attention backend every layer of the model calls (one per model runner)."""
    return llm.engine.executor.worker.runner.backend


def engine(path: str, rounds: int, vocab: int) -> dict:
    phases = {
        name: mixed_requests(n, vocab, (plen, plen), (1, 1), seed=700 + i)
        for i, (name, n, plen) in enumerate(PHASES)
    }
    with LLM(
        model=path,
        dtype="float32",
        max_model_len=2048,
        kv_cache_bytes=1024**3,
        enable_prefix_caching=False,  # every run prefills its prompts
    ) as llm:
        backend = attention_backend(llm)
        assert backend.prefill_kernel, "the kernel is not in use"
        llm.generate([p for p, _ in phases["prefill_4x512"]], exact_params(phases["prefill_4x512"]))

        def switch(side: str) -> None:
            backend.prefill_kernel = side == "kernel"

        try:
            out, same_tokens = ab_generate(
                llm,
                phases,
                rounds,
                ("kernel", "sdpa"),
                switch,
                lambda reqs: sum(len(p) for p, _ in reqs),
                unit="prompt_tok_s",
            )
        finally:
            backend.prefill_kernel = True
    return {"phases": out, "first_tokens_identical": same_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model, config = kernel_bench_model(args.model, args.threads)
    result = run_header(model)
    result["heads"] = (
        f"{config.num_heads} over {config.num_kv_heads} KV heads, dim {config.head_dim}"
    )
    result["kernel"] = kernel(config, args.reps)
    if not args.skip_engine:
        result["rounds"] = args.rounds
        result["engine"] = engine(model.path, args.rounds, config.vocab_size)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
