"""Serving benchmark: the HTTP server under a concurrency sweep, side by side with the engine
driven directly on the same requests, constrained vs unconstrained decode, and grammar
compile cache hit vs miss. Prints JSON; with --out also writes a PNG next to it.
`--replicas 1,2` instead compares engine replica counts at one concurrency (default 32).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from common import (  # noqa: E402
    DECODE_SCHEMA,
    DEFAULT_MODEL,
    closed_loop,
    free_port,
    mixed_requests,
    resolve_model,
    stream_summary,
    write_json,
)
from grammar_masks import RATIO_TARGET as JSON_DECODE_TARGET  # noqa: E402

# A sweep measures throughput at each concurrency, so nothing is shed: on the trained model a
# 64-stream level queues past the default 60 s first-token bound (503 deadline_unmeetable).
UNBOUNDED_QUEUE = {"max_queue_s": None}

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "score", "tags"],
}


async def one_request(client, url, model, prompt, max_tokens, extra) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        **extra,
    }
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # a failure after the headers went out
                raise RuntimeError(f"stream failed: {chunk['error']}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    if not stamps:
        stamps = [time.perf_counter()]
    return {
        "ttft": stamps[0] - start,
        "itl": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
        "tokens": tokens,
    }


async def http_level(url, model, requests, concurrency, extra=None) -> dict:
    extra = {"ignore_eos": True, "stream_options": {"include_usage": True}, **(extra or {})}
    async with httpx.AsyncClient(timeout=600) as client:

        async def send(item):
            prompt, max_tokens = item
            return await one_request(client, url, model, prompt, max_tokens, extra)

        results, seconds = await closed_loop(requests, concurrency, send)
    return {"concurrency": concurrency, **stream_summary(results, seconds)}


def direct_level(path: str, requests, concurrency: int, threads: int) -> float:
    """The engine alone on the same requests, keeping `concurrency` in flight."""
    import torch

    from actors import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model=path, max_model_len=1024)
    engine = llm.engine
    queue = list(requests)
    in_flight = 0
    tokens = 0
    start = time.perf_counter()
    while queue or in_flight:
        while queue and in_flight < concurrency:
            prompt, max_tokens = queue.pop()
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            engine.add_request(f"r{len(queue)}", prompt, params)
            in_flight += 1
        for out in engine.step():
            tokens += sum(len(d.token_ids) for d in out.deltas)
            in_flight -= out.finished
    seconds = time.perf_counter() - start
    llm.shutdown()
    return tokens / seconds


def grammar_service_compile_times(path: str) -> dict:
    """The grammar service alone: a compile miss vs a cache hit for the same schema."""
    from serve_app.grammar.service import GrammarService
    from serve_app.grammar.spec import GrammarSpec

    service = GrammarService(path)
    try:
        service.wait_ready()  # time the compile, not the workers' start-up
        spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
        miss = asyncio.run(service.compile(spec)).compile_seconds
        hits = [asyncio.run(service.compile(spec)).compile_seconds for _ in range(20)]
    finally:
        service.close()
    hit = statistics.median(hits)
    return {"compile_miss_ms": miss * 1e3, "cache_hit_ms": hit * 1e3, "hit_over_miss": hit / miss}


def grammar_compile_times(url: str, model: str) -> dict:
    def timed(schema):
        body = {
            "model": model,
            "prompt": "x",
            "max_tokens": 1,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": schema},
            },
        }
        start = time.perf_counter()
        httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status()
        return time.perf_counter() - start

    fresh = {**SCHEMA, "description": f"miss-{time.time_ns()}"}
    miss = timed(fresh)
    hit = statistics.median(timed(fresh) for _ in range(3))
    return {"request_with_compile_miss_ms": miss * 1e3, "request_with_cache_hit_ms": hit * 1e3}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = result["sweep"]
    xs = [lv["concurrency"] for lv in levels]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    axes[0].plot(xs, [lv["output_tok_s"] for lv in levels], marker="o")
    axes[0].set_title("output tokens/s")
    for key, ax in (("ttft_ms", axes[1]), ("itl_ms", axes[2])):
        ax.plot(xs, [lv[key]["p50"] for lv in levels], marker="o", label="p50")
        ax.plot(xs, [lv[key]["p99"] for lv in levels], marker="o", label="p99")
        ax.set_title(key.replace("_ms", " (ms)"))
        ax.legend()
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--levels", default="1,4,16,64")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="a trained preset, a seeded preset (bench, tiny) or a checkpoint folder / GGUF",
    )
    parser.add_argument("--quick", action="store_true", help="tiny checkpoint")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--replicas",
        default=None,
        help="only compare engine replica counts (e.g. 1,2) at --replica-concurrency",
    )
    parser.add_argument("--replica-concurrency", type=int, default=32)
    args = parser.parse_args()
    from serve_app.config.options import ServeConfig
    from serve_app.server import start, stop

    checkpoint = resolve_model("tiny" if args.quick else args.model)
    path = checkpoint.path
    if args.replicas:
        counts = [int(x) for x in args.replicas.split(",")]
        write_json(replicas_comparison(args, checkpoint, counts), args.out)
        return
    levels = [int(x) for x in args.levels.split(",")]
    reqs = mixed_requests(max(2 * max(levels), 16), 2048, (64, 256), (args.max_tokens,) * 2)
    port = int(os.environ.get("BENCH_PORT", "0")) or free_port()
    config = ServeConfig(
        model=path,
        port=port,
        engine={"replica_cpus": args.threads, "max_model_len": 1024, **UNBOUNDED_QUEUE},
    )
    url = start(config, ray_init_kwargs={"num_cpus": 8})
    try:
        model = config.model_id
        asyncio.run(http_level(url, model, reqs[:4], 4))  # warm-up
        sweep = []
        for c in levels:
            sweep.append(asyncio.run(http_level(url, model, reqs[: max(2 * c, 8)], c)))
        # Prompts no earlier level sent: what the sweep left in the prefix cache would
        # otherwise spare the HTTP side prefill work that the direct engine (cold) does.
        at16 = mixed_requests(32, 2048, (64, 256), (args.max_tokens,) * 2, seed=16)
        plain16 = asyncio.run(http_level(url, model, at16, 16))
        schema_extra = {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": DECODE_SCHEMA},
            },
        }
        fresh16 = mixed_requests(32, 2048, (64, 256), (args.max_tokens,) * 2, seed=17)
        constrained16 = asyncio.run(http_level(url, model, fresh16, 16, schema_extra))
        compile_times = grammar_compile_times(url, model)
    finally:
        stop()
    direct16 = direct_level(path, at16, 16, args.threads)
    result = {
        "checkpoint": checkpoint.label,
        "dtype": "float32",
        "threads": args.threads,
        "sweep": sweep,
        "http_vs_direct_at_16": {
            "http_tok_s": plain16["output_tok_s"],
            "direct_tok_s": direct16,
            "ratio": plain16["output_tok_s"] / direct16,
            "target_ratio": 0.8,
        },
        # The decode schema (production-shaped: nested objects, enums, arrays) cannot close
        # within max_tokens, so both sides stream the same number of tokens per request.
        "constrained_vs_unconstrained_at_16": {
            "unconstrained_itl_p50_ms": plain16["itl_ms"]["p50"],
            "json_schema_itl_p50_ms": constrained16["itl_ms"]["p50"],
            "unconstrained_tok_s": plain16["output_tok_s"],
            "json_schema_tok_s": constrained16["output_tok_s"],
            "ratio": plain16["itl_ms"]["p50"] / constrained16["itl_ms"]["p50"],
            "target_ratio": JSON_DECODE_TARGET,
        },
        "grammar_compile": {**compile_times, **grammar_service_compile_times(path)},
    }
    write_json(result, args.out)
    if args.out:
        plot(result, os.path.splitext(args.out)[0] + ".png")


def replicas_comparison(args: argparse.Namespace, checkpoint, counts: list[int]) -> dict:
    """The same load at one concurrency against 1, 2, ... engine replicas (TP=1 each), one
    server start per count. On a machine with few cores the replicas share them: the ratio
    then measures the cost of splitting the batch, not a speed-up."""
    from serve_app.config.options import ServeConfig
    from serve_app.server import start, stop

    c = args.replica_concurrency
    path = checkpoint.path
    reqs = mixed_requests(max(4 * c, 16), 2048, (64, 256), (args.max_tokens,) * 2)
    runs = []
    for n in counts:
        config = ServeConfig(
            model=path,
            port=free_port(),
            admin_port=free_port(),
            engine={
                "replica_cpus": args.threads,
                "max_model_len": 1024,
                "num_replicas": n,
                **UNBOUNDED_QUEUE,
            },
        )
        url = start(config, ray_init_kwargs={"num_cpus": 8})
        try:
            asyncio.run(http_level(url, config.model_id, reqs[:8], 8))  # warm-up
            level = asyncio.run(http_level(url, config.model_id, reqs, c))
            time.sleep(1)  # replicas report their stats a few times a second
            stats = httpx.get(f"http://127.0.0.1:{config.admin_port}/admin/v1/stats").json()
            # Requests each replica took, warm-up included: Serve spreads them.
            served = sorted(r["requests_total"] for r in stats["replicas"])
            runs.append({"replicas": n, **level, "requests_per_replica": served})
        finally:
            stop()
    base = runs[0]["output_tok_s"]
    return {
        "checkpoint": checkpoint.label,
        "dtype": "float32",
        "cpus": os.cpu_count(),
        "threads_per_replica": args.threads,
        "runs": runs,
        "tok_s_ratio_vs_first": [r["output_tok_s"] / base for r in runs],
    }


if __name__ == "__main__":
    main()
