"""What one Serve streaming hop costs per item: a producer deployment yields engine-sized
outputs (`RequestOutput`) as fast as a consumer deployment reads them, over Serve's default
transport (Ray actor calls) and over its gRPC transport, side by side in one run. Reports
items/s and the CPU each side's process spent per item.

    .venv/bin/python benchmarks/serve_hop.py --out benchmarks/results/serve_hop.json

Each transport runs in a fresh Ray of its own (Serve reads the setting when Ray starts).
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
from common import write_json  # noqa: E402

TRANSPORTS = {"actor_calls": {}, "grpc": {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1"}}
STREAMS = (1, 16)


class Producer:
    def cpu_s(self) -> float:
        return time.process_time()

    async def stream(self, n: int):
        from actors.outputs import RequestOutput

        for i in range(n):
            yield RequestOutput(f"r{i % 16}", [], [], 0, False)
            if i % 16 == 15:
                await asyncio.sleep(0)


class Consumer:
    def __init__(self, producer):
        self.producer = producer
        self.stream = producer.options(stream=True)

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


def measure(items: int) -> list[dict]:
    """In this process: one Ray, one Serve app, every stream count."""
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        producer = serve.deployment(Producer, max_ongoing_requests=100).bind()
        consumer = serve.deployment(Consumer, max_ongoing_requests=100).bind(producer)
        handle = serve.run(consumer, name="hop", route_prefix=None)
        handle.run.remote(16, 100).result()  # warm-up
        return [handle.run.remote(s, items // s).result() for s in STREAMS]
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=4000)
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.items)))
        return
    result: dict = {"items": args.items}
    for name, env in TRANSPORTS.items():
        child = subprocess.run(
            [sys.executable, __file__, "--child", "--items", str(args.items)],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
        )
        result[name] = json.loads(child.stdout.strip().splitlines()[-1])
    write_json(result, args.out)


if __name__ == "__main__":
    main()
