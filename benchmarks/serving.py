"""Serving benchmark: the HTTP server under a concurrency sweep; side by side with the engine
driven directly on the same fresh requests at 16 and 64 streams (interleaved runs, each
recorded), with the serving path's CPU per output token by process from /proc, and what the
same processes use on the idle server; the serving path's share of an idle server's time to
first token; constrained vs unconstrained decode;
grammar compile cache hit vs miss. Prints JSON; with --out also writes a PNG next to it.
Engine replica counts are compared by `benchmarks/replicas.py`.
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
    cpu_model,
    free_port,
    mixed_requests,
    ours_step_loop,
    resolve_model,
    write_json,
)
from cpu_accounting import (  # noqa: E402
    idle_serve_cpu,
    serve_cpu_seconds,
    serving_cpu_per_token,
    step_thread_schedstat,
    step_thread_shares,
)
from grammar_masks import RATIO_TARGET as JSON_DECODE_TARGET  # noqa: E402
from load_client import (  # noqa: E402
    closed_loop,
    run_client,
    stream_completion,
    stream_summary,
    streaming_session,
)

# A sweep measures throughput at each concurrency, so nothing is shed: on the trained model a
# 64-stream level queues past the default 60 s first-token bound (503 deadline_unmeetable).
UNBOUNDED_QUEUE = {"max_queue_s": None}
# Targets (the serving-path issue): HTTP keeps this share of the engine driven directly; the
# path outside the engine's step threads costs at most this CPU per output token at 64
# streams; it adds at most this to an idle server's time to first token.
HTTP_VS_DIRECT_TARGET = 0.9
SERVING_CPU_TARGET_MS = 0.15
TTFT_OVERHEAD_TARGET_MS = 15.0
COMPARED_LEVELS = (16, 64)
# The idle server's CPU is read over this long, after the warm-up's output channel has closed.
IDLE_SETTLE_S = 3.0
IDLE_READING_S = 10.0
STATS_PUSH_S = 0.6  # an engine replica pushes its stats every 0.2 s while they change

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "score", "tags"],
}


async def one_request(session, url, model, prompt, max_tokens, extra) -> dict:
    got = await stream_completion(session, url, model, prompt, max_tokens, extra)
    got["tokens"] = got["usage"]["completion_tokens"] if got["usage"] else 0
    return got


async def http_level(url, model, requests, concurrency, extra=None) -> dict:
    extra = {"ignore_eos": True, "stream_options": {"include_usage": True}, **(extra or {})}
    async with streaming_session() as session:

        async def send(item):
            prompt, max_tokens = item
            return await one_request(session, url, model, prompt, max_tokens, extra)

        results, seconds = await closed_loop(requests, concurrency, send)
    chunks = sum(r["chunks"] for r in results)
    return {
        "concurrency": concurrency,
        **stream_summary(results, seconds),
        # More than 1 where the server sent several tokens in one event.
        "tokens_per_chunk": sum(r["tokens"] for r in results) / max(chunks, 1),
    }


def engine_steps(admin_url: str) -> int:
    """Steps the engine replicas have run (`/admin/v1/stats`), once their reporters have
    pushed what the last level did (every 0.2 s while it changes)."""
    time.sleep(STATS_PUSH_S)
    return httpx.get(f"{admin_url}/admin/v1/stats").json()["total"]["steps_total"]


def accounted_level(url, model, requests, concurrency, admin_url: str | None = None) -> dict:
    """One HTTP level with the serving path's CPU per output token, process by process, where
    the engine's step threads spent the level and (given the admin API) the output tokens a
    step the engine ran at."""
    steps = engine_steps(admin_url) if admin_url else None
    before, sched = serve_cpu_seconds(), step_thread_schedstat()
    # The load generator runs on this thread, on the same cores as the server: its CPU per
    # token is what a remote client would not take from the engine.
    client_before = time.thread_time()
    level = run_client(http_level(url, model, requests, concurrency))
    client_s = time.thread_time() - client_before
    after = serve_cpu_seconds()
    if steps is not None:
        level["tokens_per_step"] = level["output_tokens"] / (engine_steps(admin_url) - steps)
    return {
        **level,
        "cpu_ms_per_token": serving_cpu_per_token(before, after, level["output_tokens"]),
        "client_cpu_ms_per_token": client_s * 1e3 / max(level["output_tokens"], 1),
        "engine_step_threads": step_thread_shares(sched, step_thread_schedstat(), level["seconds"]),
    }


def http_vs_direct(url, admin_url, model, path, args) -> dict:
    """`args.runs` interleaved runs at each compared level: HTTP, then the engine alone (a
    fresh one, in this process, while the server idles) on the same prompts, which neither
    side saw before (a warm prefix cache would spare one side prefill)."""
    runs: dict[int, list[dict]] = {c: [] for c in COMPARED_LEVELS}
    for r in range(args.runs):
        for c in COMPARED_LEVELS:
            reqs = mixed_requests(2 * c, 2048, (64, 256), (args.max_tokens,) * 2, seed=100 * r + c)
            http = accounted_level(url, model, reqs, c, admin_url)
            direct = direct_run(path, reqs, c, args.threads)
            runs[c].append(
                {
                    "run": r,
                    "http": http,
                    "direct_tok_s": direct["tok_s"],
                    "direct_tokens_per_step": direct["tokens_per_step"],
                }
            )
    out = {}
    for c, rows in runs.items():
        ratios = [row["http"]["output_tok_s"] / row["direct_tok_s"] for row in rows]
        cpu = [row["http"]["cpu_ms_per_token"] for row in rows]
        roles = sorted({role for x in cpu for role in x["by_role"]})
        out[c] = {
            "http_tok_s": statistics.median(row["http"]["output_tok_s"] for row in rows),
            "direct_tok_s": statistics.median(row["direct_tok_s"] for row in rows),
            "ratio": statistics.median(ratios),
            "target_ratio": HTTP_VS_DIRECT_TARGET,
            "serving_cpu_ms_per_token": statistics.median(x["serving"] for x in cpu),
            "cpu_ms_per_token_by_role": {
                role: statistics.median(x["by_role"].get(role, 0.0) for x in cpu) for role in roles
            },
            "client_cpu_ms_per_token": statistics.median(
                row["http"]["client_cpu_ms_per_token"] for row in rows
            ),
            "tokens_per_chunk": statistics.median(row["http"]["tokens_per_chunk"] for row in rows),
            # The same batches on both sides: the gap is in how long each step takes.
            "http_tokens_per_step": statistics.median(
                row["http"]["tokens_per_step"] for row in rows
            ),
            "direct_tokens_per_step": statistics.median(
                row["direct_tokens_per_step"] for row in rows
            ),
            "itl_ms_p50": statistics.median(row["http"]["itl_ms"]["p50"] for row in rows),
            "runs": rows,
        }
    return out


def ttft_overhead(url: str, admin_url: str, model: str, n: int = 20) -> dict:
    """Sequential single requests on an idle server: client TTFT minus the engine timeline's
    first-token time (from the request's arrival in the engine)."""
    reqs = mixed_requests(n, 2048, (64, 256), (8, 8), seed=999)
    extra = {"ignore_eos": True, "stream_options": {"include_usage": True}}
    samples = []

    async def run_all():
        async with streaming_session() as session:
            for prompt, max_tokens in reqs:
                samples.append(await one_request(session, url, model, prompt, max_tokens, extra))

    run_client(run_all())
    time.sleep(1.5)  # replicas push their timelines to the registry a few times a second
    overheads, engine_ttft = [], []
    for sample in samples:
        found = httpx.get(f"{admin_url}/admin/v1/requests/{sample['request_id']}").json()
        first = found["engine_requests"][-1]["timeline"]["first_token_s"]
        engine_ttft.append(first * 1e3)
        overheads.append(sample["ttft"] * 1e3 - first * 1e3)
    return {
        "p50_ms": statistics.median(overheads),
        "client_ttft_p50_ms": statistics.median(s["ttft"] * 1e3 for s in samples),
        "engine_first_token_p50_ms": statistics.median(engine_ttft),
        "target_ms": TTFT_OVERHEAD_TARGET_MS,
        "samples_ms": overheads,
    }


def direct_run(path: str, requests, concurrency: int, threads: int) -> dict:
    """The engine alone on the same requests, keeping `concurrency` in flight: its tokens a
    second and the output tokens a step it ran at."""
    import torch

    from actors import LLM

    torch.set_num_threads(threads)
    llm = LLM(model=path, max_model_len=1024)
    seconds, tokens = ours_step_loop(llm.engine, requests, concurrency)
    steps = llm.engine.num_steps
    llm.shutdown()
    return {"tok_s": tokens / seconds, "tokens_per_step": tokens / steps}


def direct_level(path: str, requests, concurrency: int, threads: int) -> float:
    """`direct_run`'s tokens a second."""
    return direct_run(path, requests, concurrency, threads)["tok_s"]


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
        "--runs", type=int, default=3, help="interleaved HTTP / direct runs per compared level"
    )
    parser.add_argument(
        "--path-only",
        action="store_true",
        help="only the serving path's figures (HTTP vs direct, CPU per token, TTFT overhead)",
    )
    parser.add_argument(
        "--constrained-only",
        action="store_true",
        help="only JSON-schema vs unconstrained streams at 16 (--runs interleaved pairs)",
    )
    parser.add_argument(
        "--direct-ingress",
        action="store_true",
        help="the ingress replica serves HTTP itself (ServeConfig.direct_ingress)",
    )
    args = parser.parse_args()
    from serve_app.config.options import ServeConfig
    from serve_app.server import start, stop

    checkpoint = resolve_model("tiny" if args.quick else args.model)
    path = checkpoint.path
    levels = [int(x) for x in args.levels.split(",")]
    reqs = mixed_requests(max(2 * max(levels), 16), 2048, (64, 256), (args.max_tokens,) * 2)
    port = int(os.environ.get("BENCH_PORT", "0")) or free_port()
    admin_port = free_port()
    config = ServeConfig(
        model=path,
        port=port,
        admin_port=admin_port,
        direct_ingress=args.direct_ingress,
        engine={"replica_cpus": args.threads, "max_model_len": 1024, **UNBOUNDED_QUEUE},
    )
    url = start(config, ray_init_kwargs={"num_cpus": 8})
    result: dict = {
        "cpu": cpu_model(),
        "checkpoint": checkpoint.label,
        "dtype": "float32",
        "threads": args.threads,
        "replica_cpus": args.threads,
        "runs_per_comparison": args.runs,
        "direct_ingress": args.direct_ingress,
    }
    try:
        model = config.model_id
        run_client(http_level(url, model, reqs[:4], 4))  # warm-up
        if args.constrained_only:
            result["constrained_vs_unconstrained_at_16"] = constrained_comparison(url, model, args)
        else:
            admin_url = f"http://127.0.0.1:{admin_port}"
            measure_path_and_sweep(result, url, admin_url, model, path, levels, reqs, args)
    finally:
        stop()
    everything = not (args.path_only or args.constrained_only)
    if everything:
        result["grammar_compile"].update(grammar_service_compile_times(path))
    write_json(result, args.out)
    if args.out and everything:
        plot(result, os.path.splitext(args.out)[0] + ".png")


def measure_path_and_sweep(
    result: dict, url: str, admin_url: str, model: str, path: str, levels, reqs, args
) -> None:
    """The serving path's figures, then (unless --path-only) the sweep, constrained decode and
    compile times, into `result`."""
    time.sleep(IDLE_SETTLE_S)
    idle = idle_serve_cpu(IDLE_READING_S)
    overhead = ttft_overhead(url, admin_url, model)
    compared = http_vs_direct(url, admin_url, model, path, args)
    # The share of the 64-stream figure the path's processes spend idle over a level as long.
    idle["path_ms_per_token_at_64"] = idle["path_ms_per_s"] / compared[64]["http_tok_s"]
    result.update(
        {
            "serving_cpu_ms_per_token": compared[64]["serving_cpu_ms_per_token"],
            "serving_cpu_target_ms": SERVING_CPU_TARGET_MS,
            "serving_cpu_breakdown_at_64": compared[64]["cpu_ms_per_token_by_role"],
            "serving_idle_cpu": idle,
            "serving_ttft_overhead_ms": overhead["p50_ms"],
            "serving_ttft_overhead": overhead,
            "http_vs_direct_at_16": compared[16],
            "http_vs_direct_at_64": compared[64],
        }
    )
    if not args.path_only:
        result["sweep"] = [
            run_client(http_level(url, model, reqs[: max(2 * c, 8)], c)) for c in levels
        ]
        result["constrained_vs_unconstrained_at_16"] = constrained_comparison(url, model, args)
        result["grammar_compile"] = grammar_compile_times(url, model)


def constrained_comparison(url: str, model: str, args: argparse.Namespace) -> dict:
    """JSON-schema vs unconstrained streams at 16: `args.runs` interleaved pairs, each level on
    prompts of its own, every run recorded; the ratio is of the medians. The decode schema
    (production-shaped: nested objects, enums, arrays) cannot close within max_tokens, so both
    sides stream the same number of tokens per request."""
    schema_extra = {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": DECODE_SCHEMA},
        },
    }
    runs: dict[str, list[dict]] = {"unconstrained": [], "json_schema": []}
    for i in range(args.runs):
        for j, (side, extra) in enumerate((("unconstrained", {}), ("json_schema", schema_extra))):
            fresh = mixed_requests(32, 2048, (64, 256), (args.max_tokens,) * 2, seed=16 + 2 * i + j)
            runs[side].append(run_client(http_level(url, model, fresh, 16, extra)))

    def median(side: str, key: str, sub: str | None = None) -> float:
        return statistics.median(r[key][sub] if sub else r[key] for r in runs[side])

    plain = median("unconstrained", "itl_ms", "p50")
    constrained = median("json_schema", "itl_ms", "p50")
    return {
        "unconstrained_itl_p50_ms": plain,
        "json_schema_itl_p50_ms": constrained,
        "unconstrained_tok_s": median("unconstrained", "output_tok_s"),
        "json_schema_tok_s": median("json_schema", "output_tok_s"),
        "ratio": plain / constrained,
        "target_ratio": JSON_DECODE_TARGET,
        "runs": runs,
    }


if __name__ == "__main__":
    main()
