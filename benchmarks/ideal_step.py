"""Our decode step against the ideal one: how much the paged KV cache and the engine cost.

The ideal step runs the same model (our modules, the same weights, the same packed linear
layers, eager, the same threads) on `batch` sequences that all have the same context, each
with its K and V contiguous in memory, attended by one SDPA call per layer over the whole
batch, then the LM head and a greedy argmax: no block table, no gather, no scheduler, no
sampler, no step input to build. Ours is `LLM`'s engine stepping the same batch in steady
decode (the step the engine benchmark's breakdown times).

    python benchmarks/ideal_step.py --model bench --batch 64 --context 256
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import resolve_model, run_header, write_json  # noqa: E402
from step_breakdown import fill_decoding  # noqa: E402

from actors import LLM  # noqa: E402
from actors.config import ModelConfig  # noqa: E402
from actors.forward_context import AttentionMetadata, set_forward_context  # noqa: E402
from actors.layers.attention import AttentionBackend  # noqa: E402
from actors.models.loader import build_model  # noqa: E402
from actors.parallel_state import ensure_single_rank_group  # noqa: E402

RATIO_TARGET = 1.3  # ours / ideal at batch 64, mean context 256


class ContiguousSDPA(AttentionBackend):
    """Per layer, K and V as (batch, kv_heads, max_context, head_dim); all sequences at one
    position. The layer is told apart by its (unused) paged cache tensor."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.store: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.position = 0

    def allocate(self, caches, batch: int, max_context: int, dtype: torch.dtype) -> None:
        shape = (batch, self.num_kv_heads, max_context, self.head_dim)
        gen = torch.Generator().manual_seed(0)
        for k_cache, _ in caches:
            k = torch.randn(shape, generator=gen, dtype=dtype) * 0.1
            self.store[k_cache.data_ptr()] = (k, torch.randn(shape, generator=gen, dtype=dtype))

    def forward(self, q, k, v, k_cache, v_cache, meta):  # type: ignore[override]
        keys, values = self.store[k_cache.data_ptr()]
        b, p = q.shape[0], self.position
        keys[:, :, p] = k
        values[:, :, p] = v
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # (b, heads, 1, d)
            keys[:, :, : p + 1],
            values[:, :, : p + 1],
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return o.reshape(b, self.num_heads * self.head_dim)


@torch.inference_mode()
def ideal_step_ms(config: ModelConfig, batch: int, context: int, steps: int) -> float:
    ensure_single_rank_group()
    backend = ContiguousSDPA(config.num_heads, config.num_kv_heads, config.head_dim)
    model = build_model(config, backend, torch.device("cpu"))
    # Paged-cache stand-ins: only their addresses are read (one per layer).
    caches = [(torch.empty(1), torch.empty(1)) for _ in range(config.num_layers)]
    backend.allocate(caches, batch, context + steps + 8, config.dtype)
    tokens = torch.randint(5, config.vocab_size, (batch,))
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long))
    times = []
    for i in range(steps + 3):  # 3 warm-up steps
        backend.position = context + i
        positions = torch.full((batch,), context + i, dtype=torch.long)
        start = time.perf_counter()
        with set_forward_context(meta):
            hidden = model(tokens, positions, caches)
        tokens = model.compute_logits(hidden).argmax(dim=-1)
        times.append(time.perf_counter() - start)
    return sum(times[3:]) / steps * 1e3


def ours_step_ms(path: str, batch: int, context: int, steps: int, kv_bytes: int) -> float:
    llm = LLM(model=path, max_model_len=context + steps + 64, kv_cache_bytes=kv_bytes)
    try:
        engine = llm.engine
        fill_decoding(engine, batch, context, engine.model_config.vocab_size, "ideal")
        for _ in range(3):  # warm-up decode steps
            engine.step()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        return (time.perf_counter() - start) / steps * 1e3
    finally:
        llm.shutdown()


def run(path: str, batch: int = 64, context: int = 256, steps: int = 10) -> dict:
    config = ModelConfig.from_pretrained(path, dtype=torch.float32, max_model_len=None)
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    kv_bytes = int(1.25 * batch * (context + steps + 64) * per_token)
    ours = ours_step_ms(path, batch, context, steps, kv_bytes)
    ideal = ideal_step_ms(config, batch, context, steps)
    return {
        f"decode_step_ms_b{batch}": ours,
        f"ideal_step_ms_b{batch}": ideal,
        "ratio": ours / ideal,
        "target": f"<= {RATIO_TARGET}",
        "met": ours / ideal <= RATIO_TARGET,
        "batch": batch,
        "context_tokens": context,
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    result = {
        **run_header(model),
        **run(model.path, args.batch, args.context, args.steps),
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
