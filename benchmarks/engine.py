"""Engine benchmark: ours vs transformers `generate` on the same requests, side by side.

Prints JSON (and writes it with --out, plus a PNG next to it). Figures are about this
machine; the ratios are what the targets speak of.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import (  # noqa: E402
    DEFAULT_MODEL,
    Timer,
    mixed_requests,
    ours_step_loop,
    resolve_model,
    run_header,
    write_json,
)
from ideal_step import run as ideal_step  # noqa: E402
from step_breakdown import run as step_breakdown  # noqa: E402

from actors import LLM, SamplingParams  # noqa: E402


def hf_static_batches(hf, requests, batch_size: int) -> float:
    """Seconds to run `requests` through HF generate in static, left-padded batches."""
    from transformers import GenerationConfig

    with Timer() as t:
        for start in range(0, len(requests), batch_size):
            batch = requests[start : start + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.full((len(batch), width), 2, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, (p, _) in enumerate(batch):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            config = GenerationConfig(
                max_new_tokens=max(m for _, m in batch),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )
            with torch.no_grad():
                hf.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return t.seconds


def ours_offline(llm: LLM, requests) -> float:
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in requests]
    with Timer() as t:
        llm.generate([p for p, _ in requests], params)
    return t.seconds


def batch1_decode_ms(llm: LLM, prompt, num_tokens: int) -> float:
    """Milliseconds per decoded token for one sequence (the first token's step excluded)."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up
    with Timer() as full:
        llm.generate([prompt], params)
    with Timer() as first:
        llm.generate([prompt], one)
    return (full.seconds - first.seconds) / (num_tokens - 1) * 1e3


def batch1_decode(llm: LLM, hf, prompt, num_tokens: int) -> dict:
    from transformers import GenerationConfig

    ours = batch1_decode_ms(llm, prompt, num_tokens) / 1e3

    def hf_run(n):
        config = GenerationConfig(
            max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2
        )
        with torch.no_grad(), Timer() as t:
            hf.generate(torch.tensor([prompt]), generation_config=config)
        return t.seconds

    hf_run(num_tokens)
    theirs = (hf_run(num_tokens) - hf_run(1)) / (num_tokens - 1)
    return {
        "ours_ms_per_token": ours * 1e3,
        "hf_ms_per_token": theirs * 1e3,
        "ratio": ours / theirs,
    }


def prefix_cache_ttft(llm: LLM, vocab: int) -> dict:
    import random

    rng = random.Random(99)
    prefix = [rng.randrange(5, vocab) for _ in range(512)]
    one = SamplingParams(max_tokens=1, temperature=0)
    cold_times, warm_times = [], []
    for i in range(3):
        llm.engine.block_manager.reset_prefix_cache()
        with Timer() as cold:
            llm.generate([prefix + [5 + i, 6]], one)
        with Timer() as warm:
            llm.generate([prefix + [7 + i, 8]], one)
        cold_times.append(cold.seconds)
        warm_times.append(warm.seconds)
    cold_s, warm_s = min(cold_times), min(warm_times)
    return {"cold_ttft_ms": cold_s * 1e3, "cached_ttft_ms": warm_s * 1e3, "ratio": warm_s / cold_s}


def tensor_parallel(path: str, requests) -> dict:
    """TP=1 against the smallest TP size above 1 that divides the model's heads (2 on
    `bench`, 3 on SmolLM2's 9 heads over 3 KV heads)."""
    import math

    import ray
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    heads = math.gcd(config.num_attention_heads, config.num_key_value_heads)
    wide = next(n for n in range(2, heads + 1) if heads % n == 0)

    # address="local": never join another Ray that happens to run on this machine.
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        out = {}
        for tp in (1, wide):
            llm = LLM(model=path, tensor_parallel_size=tp)
            ours_offline(llm, requests[:4])  # warm-up
            seconds = ours_offline(llm, requests)
            tokens = sum(m for _, m in requests)
            steps = llm.engine.num_steps
            out[f"tp{tp}"] = {
                "tokens_per_s": tokens / seconds,
                "ms_per_step": seconds / max(steps, 1) * 1e3,
            }
            if tp > 1:
                out["step_overhead_ms"] = llm.engine.executor.measure_step_overhead() * 1e3
            llm.shutdown()
        out[f"tp{wide}_over_tp1"] = out[f"tp{wide}"]["tokens_per_s"] / out["tp1"]["tokens_per_s"]
        return out
    finally:
        ray.shutdown()


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thr = result["offline_throughput"]
    fig, (ax, parts_ax) = plt.subplots(1, 2, figsize=(12, 3.8))
    names, values = ["ours", "transformers\n(static batches)"], [thr["ours_tok_s"], thr["hf_tok_s"]]
    if "cpu_linear" in result:
        names.insert(1, "ours, F.linear\n(no packing)")
        values.insert(1, result["cpu_linear"]["dense_tok_s"])
    if "decode_gather" in result:
        names.insert(1, "ours, fresh\ndecode gathers")
        values.insert(1, result["decode_gather"]["fresh_tok_s"])
    ax.bar(names, values)
    ax.set_ylabel("useful output tokens/s")
    ax.set_title(f"{thr['num_requests']} mixed requests, {result['checkpoint']} (CPU)")
    _plot_breakdown(parts_ax, result["step_breakdown"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _plot_breakdown(ax, steps: list[dict]) -> None:
    """Stacked bars: a decode step's milliseconds by part, at each batch size."""
    from step_breakdown import PARTS

    labels = [f"batch {s['batch']}" for s in steps]
    bottom = [0.0] * len(steps)
    for part in PARTS:
        values = [s["ms"][part] for s in steps]
        ax.bar(labels, values, bottom=bottom, label=part.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylabel("ms per decode step")
    ax.set_title("where a decode step goes")
    ax.legend(fontsize=7)


def dense_linear(path: str, requests, packed_s: float) -> dict:
    """The same requests with linear layers on plain F.linear (SERVE_APP_CPU_PREPACK=0):
    what the oneDNN packed weights of actors/layers/prepack.py are worth here."""
    os.environ["SERVE_APP_CPU_PREPACK"] = "0"
    try:
        llm = LLM(model=path, max_model_len=1024)
    finally:
        del os.environ["SERVE_APP_CPU_PREPACK"]
    ours_offline(llm, requests[:4])  # warm-up
    dense_s = ours_offline(llm, requests)
    decode = batch1_decode_ms(llm, requests[0][0][:16], 64)
    llm.shutdown()
    tokens = sum(m for _, m in requests)
    return {
        "packed_tok_s": tokens / packed_s,
        "dense_tok_s": tokens / dense_s,
        "speedup": dense_s / packed_s,
        "dense_batch1_ms_per_token": decode,
    }


def closed_loop_tok_s(llm: LLM, requests, streams: int) -> dict:
    """`streams` requests in the engine at all times (a new one as each ends), as a server
    at that concurrency sees them: output tokens/s and the share of decode buckets whose
    gather was kept from the step before."""
    counts = llm.engine.executor.worker.runner.gather_counts
    before = dict(counts)
    seconds, tokens = ours_step_loop(llm.engine, requests, streams)
    kept, built = (counts[k] - before[k] for k in ("kept", "buckets"))
    return {"tok_s": tokens / seconds, "kept_share": kept / max(1, built)}


def decode_gathers(path: str, requests, stream_requests, kept_s: float) -> dict:
    """Kept decode gathers (actors/layers/attention.py) against a fresh gather every step
    (SERVE_APP_DECODE_GATHER_REUSE=0): the same offline requests, and 16 closed-loop streams
    of 64 new tokens (prompts 64-256), each side on its own engine."""
    out = {"kept_tok_s": sum(m for _, m in requests) / kept_s}
    for name, env in (("kept", "1"), ("fresh", "0")):
        os.environ["SERVE_APP_DECODE_GATHER_REUSE"] = env
        try:
            llm = LLM(model=path, max_model_len=1024)
        finally:
            del os.environ["SERVE_APP_DECODE_GATHER_REUSE"]
        ours_offline(llm, requests[:4])  # warm-up
        if name == "fresh":
            out["fresh_tok_s"] = sum(m for _, m in requests) / ours_offline(llm, requests)
        out[f"streams16_{name}"] = closed_loop_tok_s(llm, stream_requests, 16)
        llm.shutdown()
    out["speedup"] = out["kept_tok_s"] / out["fresh_tok_s"]
    out["streams16_speedup"] = out["streams16_kept"]["tok_s"] / out["streams16_fresh"]["tok_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="a trained preset, a seeded preset (bench, tiny) or a checkpoint folder / GGUF",
    )
    parser.add_argument("--quick", action="store_true", help="tiny checkpoint, few requests")
    parser.add_argument("--skip-tp", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    model = resolve_model("tiny" if args.quick else args.model)
    path = model.path
    n = 8 if args.quick else args.num_requests
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    requests = mixed_requests(n, vocab, output_range=(16, 64 if args.quick else 256))
    llm = LLM(model=path, max_model_len=1024)
    ours_offline(llm, requests[:4])  # warm-up
    tokens = sum(m for _, m in requests)
    ours_s = ours_offline(llm, requests)
    hf_s = hf_static_batches(hf, requests, args.hf_batch_size)
    result = {
        "machine": {"torch_threads": torch.get_num_threads(), "device": "cpu"},
        **run_header(model),
        "offline_throughput": {
            "num_requests": n,
            "useful_output_tokens": tokens,
            "ours_tok_s": tokens / ours_s,
            "hf_tok_s": tokens / hf_s,
            "ratio": hf_s / ours_s,
            "target_ratio": 2.0,
        },
        "batch1_decode": {**batch1_decode(llm, hf, requests[0][0][:16], 64), "target_ratio": 1.2},
        "prefix_cache": {**prefix_cache_ttft(llm, vocab), "target_ratio": 0.3},
    }
    llm.shutdown()
    batches = [1, 4] if args.quick else [1, 16, 64]
    result["step_breakdown"] = step_breakdown(
        path, batches, steps=5 if args.quick else 20, prompt_len=128
    )
    # Ours against the ideal step (contiguous KV, one SDPA per layer): batch 64, context 256.
    result["ideal_step"] = ideal_step(path, 8 if args.quick else 64, 64 if args.quick else 256)
    result["cpu_linear"] = dense_linear(path, requests, ours_s)
    streams = 16 if args.quick else 96
    stream_requests = mixed_requests(streams, vocab, (64, 256), (64, 64), seed=2)
    result["decode_gather"] = decode_gathers(path, requests, stream_requests, ours_s)
    if not args.skip_tp:
        result["tensor_parallel"] = tensor_parallel(path, requests[: max(8, n // 4)])
    write_json(result, args.out)
    if args.out:
        plot(result, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
