"""Streamed `/v1/responses` vs streamed chat completions on the same prompts and the same
server: tokens/s, TTFT and ITL at 16 streams (interleaved runs, every run recorded, the
ratio the median of adjacent pairs), the ingress's CPU per output token from /proc, and what
a stored response costs the store (bytes the ingress process wrote per response, the SQLite
files' growth). Prints JSON; with --out writes it there too.

    .venv/bin/python benchmarks/responses.py --out benchmarks/results/responses.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from common import DEFAULT_MODEL, free_port, resolve_model, text_prompts, write_json  # noqa: E402
from cpu_accounting import (  # noqa: E402
    BACKGROUND_ROLES,
    serve_cpu_seconds,
    serving_cpu_per_token,
)
from load_client import closed_loop, stream_summary  # noqa: E402

# The Responses issue's target: streamed /v1/responses keeps this share of chat's tokens/s.
RATIO_TARGET = 0.95


async def chat_stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, n: int):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stamps, tokens, start = [], 0, time.perf_counter()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    return _timeline(start, stamps, tokens)


async def responses_stream(client: httpx.AsyncClient, url: str, model: str, prompt: str, n: int):
    body = {
        "model": model,
        "input": prompt,
        "max_output_tokens": n,
        "temperature": 0,
        "stream": True,
    }
    stamps, tokens, start = [], 0, time.perf_counter()
    async with client.stream("POST", f"{url}/v1/responses", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            kind = event.get("type")
            if kind == "response.output_text.delta" and event.get("delta"):
                stamps.append(time.perf_counter())
            elif kind in ("response.completed", "response.incomplete", "response.failed"):
                tokens = (event["response"].get("usage") or {}).get("output_tokens", 0)
    return _timeline(start, stamps, tokens)


def _timeline(start: float, stamps: list[float], tokens: int) -> dict:
    chunks = len(stamps)
    stamps = stamps or [time.perf_counter()]
    return {
        "ttft": stamps[0] - start,
        "itl": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
        "tokens": tokens,
        "chunks": chunks,
    }


SENDERS = {"chat": chat_stream, "responses": responses_stream}


def ingress_written_bytes() -> int:
    """Bytes the ingress replicas' processes have passed to write() so far (/proc/PID/io)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            if title.startswith("ray::") and ":ingress" in title:
                io = dict(line.split(": ") for line in (entry / "io").read_text().splitlines())
                total += int(io["wchar"])
        except (OSError, ValueError, KeyError):
            continue
    return total


def store_bytes(data_dir: Path) -> int:
    return sum(p.stat().st_size for p in data_dir.glob("*") if p.is_file())


def level(side: str, url: str, model: str, prompts, concurrency: int, max_tokens: int, data_dir):
    cpu_before, wrote_before = serve_cpu_seconds(), ingress_written_bytes()
    disk_before = store_bytes(data_dir)

    async def run():
        async with httpx.AsyncClient(timeout=600) as client:

            async def send(prompt):
                return await SENDERS[side](client, url, model, prompt, max_tokens)

            return await closed_loop(prompts, concurrency, send)

    results, seconds = asyncio.run(run())
    summary = stream_summary(results, seconds)
    # The responses runner is on /v1/responses' path; both sides count it, to compare alike.
    background = tuple(r for r in BACKGROUND_ROLES if r != "responses")
    cpu = serving_cpu_per_token(
        cpu_before, serve_cpu_seconds(), summary["output_tokens"], background
    )
    return {
        "side": side,
        **summary,
        "tokens_per_chunk": summary["output_tokens"] / max(sum(r["chunks"] for r in results), 1),
        "ingress_cpu_ms_per_token": cpu["by_role"].get("ingress", 0.0),
        "serving_cpu_ms_per_token": cpu["serving"],
        "ingress_bytes_written_per_request": (ingress_written_bytes() - wrote_before)
        / len(results),
        "store_growth_bytes_per_request": (store_bytes(data_dir) - disk_before) / len(results),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3, help="interleaved pairs")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from serve_app.config.options import ServeConfig
    from serve_app.server import start, stop

    checkpoint = resolve_model(args.model)
    data_dir = Path(tempfile.mkdtemp(prefix="responses-bench-"))
    config = ServeConfig(
        model=checkpoint.path,
        port=free_port(),
        admin_port=free_port(),
        engine={"replica_cpus": args.threads, "max_model_len": 1024, "max_queue_s": None},
        generations={"data_dir": str(data_dir)},
    )
    # Fresh prompts for every level (the prefix cache would favour whichever side ran later
    # on prompts it had seen): the warm-up's, then one slice per run.
    num_levels = 2 + 2 * args.runs
    texts = [
        text for text, _ in text_prompts(checkpoint.path, args.requests * num_levels, (64, 256))
    ]
    slices = iter(texts[i * args.requests : (i + 1) * args.requests] for i in range(num_levels))
    url = start(config, ray_init_kwargs={"num_cpus": 8})
    runs: list[dict] = []
    try:
        model = config.model_id
        for side in SENDERS:  # warm-up at full width: both paths, the step's batch sizes
            level(side, url, model, next(slices), args.streams, args.max_tokens, data_dir)
        for i in range(args.runs):
            order = ("chat", "responses") if i % 2 == 0 else ("responses", "chat")
            for side in order:
                prompts = next(slices)
                runs.append(
                    level(side, url, model, prompts, args.streams, args.max_tokens, data_dir)
                )
    finally:
        stop()
    pairs = [{r["side"]: r for r in runs[2 * i : 2 * i + 2]} for i in range(args.runs)]
    ratios = [p["responses"]["output_tok_s"] / p["chat"]["output_tok_s"] for p in pairs]

    def median_of(side: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["side"] == side)

    result = {
        "checkpoint": checkpoint.label,
        "dtype": "float32",
        "threads": args.threads,
        "replica_cpus": args.threads,
        "streams": args.streams,
        "requests_per_run": args.requests,
        "max_tokens": args.max_tokens,
        "runs": runs,
        "responses_vs_chat_tok_s": {
            "pairs": ratios,
            "ratio": statistics.median(ratios),
            "target": RATIO_TARGET,
            "met": statistics.median(ratios) >= RATIO_TARGET,
        },
        "median": {
            side: {
                key: median_of(side, key)
                for key in (
                    "output_tok_s",
                    "ingress_cpu_ms_per_token",
                    "ingress_bytes_written_per_request",
                    "store_growth_bytes_per_request",
                )
            }
            for side in SENDERS
        },
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
