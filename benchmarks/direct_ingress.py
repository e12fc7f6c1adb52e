"""Serve's direct ingress against Serve's proxy, in one server: with `direct_ingress` the
ingress replica serves the server's port itself, and Serve (2.60) still runs its proxy (on a
port the OS picked) in front of the same replica. Each run sends a level through the proxy
and a level to the replica's own port, in alternating order, on fresh prompts each, and the
engine alone (a fresh one, in this process) on the same prompts; the serving path's CPU per
output token by process from /proc, as `serving.py` measures it. Prints JSON, every run
recorded; the idle TTFT overhead of each side too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import httpx
import psutil

sys.path.insert(0, os.path.dirname(__file__))
import serving  # noqa: E402
from common import free_port, mixed_requests, resolve_model, write_json  # noqa: E402
from load_client import run_client, streaming_session  # noqa: E402

SIDES = ("proxy", "direct_ingress")
LEVELS = (16, 64)


def proxy_url() -> str:
    """Where this machine's Serve proxy serves HTTP (the OS picked its port; the proxy also
    listens for gRPC)."""
    for proc in psutil.process_iter(["cmdline"]):
        if not (proc.info["cmdline"] or [""])[0].startswith("ray::ProxyActor"):
            continue
        for conn in proc.net_connections("tcp"):
            if conn.status != psutil.CONN_LISTEN:
                continue
            url = f"http://127.0.0.1:{conn.laddr.port}"
            try:
                if httpx.get(f"{url}/-/healthz", timeout=5).text == "success":
                    return url
            except httpx.HTTPError:
                continue
    raise RuntimeError("no Serve proxy serving HTTP on this machine")


def ttft_overhead(url: str, admin_url: str, model: str, seed: int, n: int = 20) -> dict:
    """`serving.ttft_overhead` on prompts of this side's own."""
    reqs = mixed_requests(n, 2048, (64, 256), (8, 8), seed=seed)
    extra = {"ignore_eos": True, "stream_options": {"include_usage": True}}

    async def run_all() -> list[dict]:
        async with streaming_session() as session:
            return [await serving.one_request(session, url, model, p, m, extra) for p, m in reqs]

    samples = run_client(run_all())
    time.sleep(1.5)  # replicas push their timelines to the registry a few times a second
    overheads = []
    for s in samples:
        found = httpx.get(f"{admin_url}/admin/v1/requests/{s['request_id']}").json()
        first = found["engine_requests"][-1]["timeline"]["first_token_s"]
        overheads.append(s["ttft"] * 1e3 - first * 1e3)
    return {
        "p50_ms": statistics.median(overheads),
        "client_ttft_p50_ms": statistics.median(s["ttft"] * 1e3 for s in samples),
    }


def one_run(r: int, c: int, urls: dict, model: str, path: str, args) -> dict:
    order = SIDES if r % 2 == 0 else SIDES[::-1]
    row: dict = {"run": r, "concurrency": c, "order": list(order)}
    for k, side in enumerate(order):
        reqs = mixed_requests(2 * c, 2048, (64, 256), (args.max_tokens,) * 2, seed=1000 * r + c + k)
        level = serving.accounted_level(urls[side], model, reqs, c)
        row[side] = {
            "tok_s": level["output_tok_s"],
            "cpu_ms_per_token": level["cpu_ms_per_token"],
            "tokens_per_chunk": level["tokens_per_chunk"],
            "itl_ms_p50": level["itl_ms"]["p50"],
        }
    row["direct_tok_s"] = serving.direct_level(path, reqs, c, args.threads)
    for side in order:
        row[side]["ratio"] = row[side]["tok_s"] / row["direct_tok_s"]
    print(r, c, {s: round(row[s]["ratio"], 3) for s in SIDES}, file=sys.stderr, flush=True)
    return row


def summary(rows: list[dict]) -> dict:
    out = {}
    for side in SIDES:
        cpu = [row[side]["cpu_ms_per_token"] for row in rows]
        roles = sorted({role for x in cpu for role in x["by_role"]})
        out[side] = {
            "tok_s": statistics.median(row[side]["tok_s"] for row in rows),
            "ratio": statistics.median(row[side]["ratio"] for row in rows),
            "serving_cpu_ms_per_token": statistics.median(x["serving"] for x in cpu),
            "cpu_ms_per_token_by_role": {
                role: statistics.median(x["by_role"].get(role, 0.0) for x in cpu) for role in roles
            },
        }
    out["direct_tok_s"] = statistics.median(row["direct_tok_s"] for row in rows)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="bench")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from serve_app.config.options import ServeConfig
    from serve_app.server import start, stop

    checkpoint = resolve_model(args.model)
    admin_port = free_port()
    config = ServeConfig(
        model=checkpoint.path,
        port=free_port(),
        admin_port=admin_port,
        direct_ingress=True,
        engine={"replica_cpus": args.threads, "max_model_len": 1024, **serving.UNBOUNDED_QUEUE},
    )
    urls = {"direct_ingress": start(config, ray_init_kwargs={"num_cpus": 8})}
    urls["proxy"] = proxy_url()
    admin_url = f"http://127.0.0.1:{admin_port}"
    model = config.model_id
    result: dict = {
        "checkpoint": checkpoint.label,
        "dtype": "float32",
        "threads": args.threads,
        "replica_cpus": args.threads,
        "max_tokens": args.max_tokens,
    }
    try:
        for url in urls.values():  # warm-up
            run_client(
                serving.http_level(url, model, mixed_requests(4, 2048, (64, 256), (16, 16)), 4)
            )
        result["ttft_overhead"] = {
            side: ttft_overhead(urls[side], admin_url, model, seed=900 + i)
            for i, side in enumerate(SIDES)
        }
        runs = [
            one_run(r, c, urls, model, checkpoint.path, args)
            for r in range(args.runs)
            for c in LEVELS
        ]
    finally:
        stop()
    for c in LEVELS:
        rows = [row for row in runs if row["concurrency"] == c]
        result[f"at_{c}"] = {**summary(rows), "runs": rows}
    write_json(result, args.out)


if __name__ == "__main__":
    main()
