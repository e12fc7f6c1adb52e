"""What one Serve hop costs: per item of a stream, and per call.

- Per item: a producer deployment yields engine-sized outputs (`RequestOutput`) as fast as a
  consumer deployment reads them.
- Per call: 16 tasks of the consumer call the producer back to back, a unary call (one small
  reply) and streamed ones of one and of two outputs (an engine call that gives its first
  output with where it was routed, or after it). This is what each request pays for each
  handle call, whatever it carries.

Over Serve's default transport (Ray actor calls), its gRPC transport, and the gRPC transport
with the rest of the settings the served path runs with (`serve_app.ray_env.SETTINGS`: the
router and user code on the replica's own loop, metrics exported once a second), side by
side in one run. Reports calls or items per second and the CPU each side's process spent per
call or item, its idle rate (measured for 3 s before) subtracted.

    .venv/bin/python benchmarks/serve_hop.py --out benchmarks/results/serve_hop.json

Each transport runs in a fresh Ray of its own (Serve reads the settings when Ray starts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import cpu_model, write_json  # noqa: E402

from serve_app import ray_env  # noqa: E402

TRANSPORTS = {
    "actor_calls": {},
    "grpc": {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"},
    "served_settings": dict(ray_env.SETTINGS),
}
STREAMS = (1, 16)
CALLERS = 16
# Streamed calls by their number of items: an engine call that says where it was routed and
# then gives its first output (two), or both in one item (one).
STREAMED = {"streamed_1_item": 1, "streamed_2_items": 2}
IDLE_S = 3.0


class Producer:
    def cpu_s(self) -> float:
        return time.process_time()

    async def stream(self, n: int):
        from actors.outputs import RequestOutput

        for i in range(n):
            yield RequestOutput(f"r{i % 16}", [], [], 0, False)
            if i % 16 == 15:
                await asyncio.sleep(0)

    async def unary(self, x: int) -> int:
        return x

    async def routed(self, num_items: int):
        from actors.outputs import RequestOutput

        for i in range(num_items):
            yield RequestOutput("r", [], [], 0, i == num_items - 1)


class Consumer:
    def __init__(self, producer):
        self.producer = producer
        self.stream = producer.options(stream=True)

    async def idle(self, seconds: float) -> tuple[float, float]:
        """CPU seconds per second of each side's process while nothing is asked of it."""
        producer_cpu = await self.producer.cpu_s.remote()
        cpu = time.process_time()
        await asyncio.sleep(seconds)
        producer_cpu = await self.producer.cpu_s.remote() - producer_cpu
        return producer_cpu / seconds, (time.process_time() - cpu) / seconds

    async def calls(self, kind: str, num_calls: int, idle: tuple[float, float]) -> dict:
        producer_cpu = await self.producer.cpu_s.remote()
        cpu, start = time.process_time(), time.perf_counter()

        async def caller(n: int) -> None:
            for _ in range(n):
                if kind == "unary":
                    await self.producer.unary.remote(1)
                else:
                    async for _ in self.stream.routed.remote(STREAMED[kind]):
                        pass

        await asyncio.gather(*(caller(num_calls // CALLERS) for _ in range(CALLERS)))
        wall = time.perf_counter() - start
        producer_cpu = await self.producer.cpu_s.remote() - producer_cpu
        consumer_cpu = time.process_time() - cpu
        return {
            "call": kind,
            "callers": CALLERS,
            "calls": num_calls,
            "calls_per_s": num_calls / wall,
            "producer_cpu_us_per_call": (producer_cpu - idle[0] * wall) / num_calls * 1e6,
            "consumer_cpu_us_per_call": (consumer_cpu - idle[1] * wall) / num_calls * 1e6,
        }

    async def run(self, num_streams: int, items_per_stream: int) -> dict:
        producer_cpu = await self.producer.cpu_s.remote()
        cpu, start = time.process_time(), time.perf_counter()

        async def read_one() -> int:
            count = 0
            async for _ in self.stream.stream.remote(items_per_stream):
                count += 1
            return count

        items = sum(await asyncio.gather(*(read_one() for _ in range(num_streams))))
        wall = time.perf_counter() - start
        producer_cpu = await self.producer.cpu_s.remote() - producer_cpu
        return {
            "streams": num_streams,
            "items": items,
            "items_per_s": items / wall,
            "producer_cpu_us_per_item": producer_cpu / items * 1e6,
            "consumer_cpu_us_per_item": (time.process_time() - cpu) / items * 1e6,
        }


async def measure(items: int, calls: int) -> dict:
    """In this process: one Ray, one Serve app, every stream count and both kinds of call.
    (Awaited in an event loop: under the served settings a handle's router runs on its
    caller's loop.)"""
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        producer = serve.deployment(Producer, max_ongoing_requests=100).bind()
        consumer = serve.deployment(Consumer, max_ongoing_requests=100).bind(producer)
        handle = serve.run(consumer, name="hop", route_prefix=None)
        await handle.run.remote(16, 100)  # warm-up
        streams = [await handle.run.remote(s, items // s) for s in STREAMS]
        idle = await handle.idle.remote(IDLE_S)
        per_call = []
        for kind in ("unary", *STREAMED):
            await handle.calls.remote(kind, CALLERS * 10, idle)  # warm-up
            per_call.append(await handle.calls.remote(kind, calls, idle))
        return {
            "streams": streams,
            "calls": per_call,
            "idle_cpu_ms_per_s": {"producer": idle[0] * 1e3, "consumer": idle[1] * 1e3},
        }
    finally:
        await serve.shutdown_async()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=4000)
    parser.add_argument("--calls", type=int, default=3200)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(measure(args.items, args.calls))))
        return
    result: dict = {"items": args.items, "calls": args.calls, "cpu": cpu_model()}
    for name, env in TRANSPORTS.items():
        child = subprocess.run(
            [sys.executable, __file__, "--child", "--items", str(args.items)]
            + ["--calls", str(args.calls)],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
        )
        result[name] = json.loads(child.stdout.strip().splitlines()[-1])
    write_json(result, args.out)


if __name__ == "__main__":
    main()
