"""Lifecycle under load, over HTTP against a real server: the token rate of normal streams
while 25% of the clients read slowly vs with no slow clients, and the time from a client
disconnect until the engine is back at its KV baseline (p50/p99).

    .venv/bin/python benchmarks/lifecycle.py [--quick] [--out benchmarks/results/lifecycle.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from common import checkpoint, free_port, percentile, write_json  # noqa: E402

# Long enough that an unread stream outgrows the socket buffers (~265 bytes per event).
SLOW_MAX_TOKENS = 900


def body(model: str, prompt: str, max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


async def normal_stream(http, url, model, max_tokens) -> float:
    """One stream read as fast as it arrives: its decode rate in tokens/s."""
    first = last = None
    count = 0
    async with http.stream(
        "POST", f"{url}/v1/completions", json=body(model, "a story", max_tokens)
    ) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                now = time.perf_counter()
                first = first or now
                last = now
                count += 1
    return (count - 1) / (last - first) if count > 1 and last > first else float("nan")


async def slow_stream(url, model, max_tokens, stop: asyncio.Event) -> None:
    """A client that reads one event every 0.5 s until the normal clients are done, through
    a small socket receive buffer: a few KiB unread fill it, so its proxy sees it stall."""
    transport = httpx.AsyncHTTPTransport(
        socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)]
    )
    async with (
        httpx.AsyncClient(timeout=600, transport=transport) as http,
        http.stream("POST", f"{url}/v1/completions", json=body(model, "slow", max_tokens)) as r,
    ):
        async for _ in r.aiter_lines():
            if stop.is_set():
                return
            await asyncio.sleep(0.5)


async def wait_held(admin_url: str, count: int, timeout_s: float = 300.0) -> float:
    """Seconds until the engine holds `count` requests (the slow readers' buffers full)."""
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=30) as http:
        while True:
            total = (await http.get(f"{admin_url}/admin/v1/stats")).json()["total"]
            if total["held"] >= count:
                return time.perf_counter() - start
            if time.perf_counter() - start > timeout_s:
                raise TimeoutError(f"{count} slow readers not held after {timeout_s:.0f}s")
            await asyncio.sleep(0.1)


async def mixed(url, admin_url, model, num_normal, num_slow, rounds, max_tokens) -> float:
    """Mean decode rate of the normal streams, with `num_slow` slow readers alongside. The
    slow readers start first; the normal streams start once the engine holds all of them,
    so the figure is the steady state (not the seconds their buffers take to fill)."""
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=num_normal + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        slow = [
            asyncio.create_task(slow_stream(url, model, SLOW_MAX_TOKENS, stop))
            for _ in range(num_slow)
        ]
        if num_slow:
            await wait_held(admin_url, num_slow)
        rates: list[float] = []

        async def worker():
            for _ in range(rounds):
                rates.append(await normal_stream(http, url, model, max_tokens))

        await asyncio.gather(*(worker() for _ in range(num_normal)))
        stop.set()
        for task in slow:
            task.cancel()
        await asyncio.gather(*slow, return_exceptions=True)
    return sum(rates) / len(rates)


async def _engine_handle(serve):
    return serve.get_deployment_handle("engine", app_name="serve-app")


async def _ask_stats(engine) -> dict:
    return await engine.stats.remote()


def disconnect_to_baseline(url: str, model: str, trials: int) -> list[float]:
    """Seconds from closing a stream mid-generation until the engine reports its KV blocks
    and live requests back at the idle baseline (polled through the engine handle)."""
    from ray import serve

    # Serve's router runs on its caller's event loop (serve_app/ray_env.py): the handle lives
    # on a loop of its own, in a thread, for the synchronous polling below.
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    engine = asyncio.run_coroutine_threadsafe(_engine_handle(serve), loop).result()

    def stats() -> dict:
        return asyncio.run_coroutine_threadsafe(_ask_stats(engine), loop).result()

    baseline = stats()["kv_blocks_used"]
    times = []
    with httpx.Client(timeout=600) as http:
        for i in range(trials):
            req = body(model, f"leaving {i}", 1000)
            with http.stream("POST", f"{url}/v1/completions", json=req) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n >= 6:
                        break
                left = time.perf_counter()
            while True:
                s = stats()
                if s["kv_blocks_used"] <= baseline and s["live_requests"] == 0:
                    times.append(time.perf_counter() - left)
                    break
                time.sleep(0.002)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from serve_app.config.options import ServeConfig
    from serve_app.server import start, stop

    path = checkpoint("llama", "tiny" if args.quick else "bench")
    config = ServeConfig(
        model=path,
        port=free_port(),
        admin_port=free_port(),
        engine={"replica_cpus": 2, "max_model_len": 1024},
    )
    rounds, max_tokens, trials = (1, 32, 10) if args.quick else (3, 64, 40)
    url = start(config, ray_init_kwargs={"num_cpus": 8})
    try:
        model = config.model_id
        admin_url = f"http://127.0.0.1:{config.admin_port}"
        asyncio.run(mixed(url, admin_url, model, 4, 0, 1, 8))  # warm-up
        alone = asyncio.run(mixed(url, admin_url, model, 12, 0, rounds, max_tokens))
        with_slow = asyncio.run(mixed(url, admin_url, model, 12, 4, rounds, max_tokens))
        leave = disconnect_to_baseline(url, model, trials)
    finally:
        stop()
    result = {
        "checkpoint": "llama-tiny" if args.quick else "llama-bench",
        "slow_consumers": {
            "normal_streams": 12,
            "slow_streams": 4,
            "slow_stream_reads_per_s": 2,
            "slow_stream_rcvbuf_bytes": 4096,
            "normal_decode_tok_s_alone": alone,
            "normal_decode_tok_s_with_slow": with_slow,
            "ratio": with_slow / alone,
            "target_ratio": 0.9,
        },
        "disconnect_to_kv_baseline_ms": {
            "trials": len(leave),
            "p50": percentile(leave, 50) * 1e3,
            "p99": percentile(leave, 99) * 1e3,
        },
    }
    write_json(result, args.out)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
