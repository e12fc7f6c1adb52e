"""Engine replica counts under one load: the same closed-loop streams at one concurrency
(default 32) against 1, 2, ... engine replicas (TP=1 each), one server start per count.
Prints JSON (tokens/s, latencies, requests each replica took)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from common import DEFAULT_MODEL, free_port, mixed_requests, resolve_model, write_json  # noqa: E402
from serving import UNBOUNDED_QUEUE, http_level  # noqa: E402


def replicas_comparison(args: argparse.Namespace, checkpoint, counts: list[int]) -> dict:
    """The same load at one concurrency against 1, 2, ... engine replicas (TP=1 each), one
    server start per count. On a machine with few cores the replicas share them: the ratio
    then measures the cost of splitting the batch, not a speed-up."""
    from serve_app.config.options import ServeConfig
    from serve_app.server import start, stop

    c = args.concurrency
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--counts", default="1,2", help="engine replica counts to compare")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="a trained preset, a seeded preset (bench, tiny) or a checkpoint folder / GGUF",
    )
    parser.add_argument("--quick", action="store_true", help="tiny checkpoint")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    checkpoint = resolve_model("tiny" if args.quick else args.model)
    counts = [int(x) for x in args.counts.split(",")]
    write_json(replicas_comparison(args, checkpoint, counts), args.out)


if __name__ == "__main__":
    main()
