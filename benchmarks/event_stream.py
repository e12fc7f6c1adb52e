"""What a streamed response costs to start and end, apart from its events: Starlette's
`StreamingResponse` and the service's `EventStreamResponse` (serve_app/protocol/event_stream.py)
under an ASGI 2.3 server (uvicorn's spec, as Serve runs it: each watches for the client's
disconnect beside the body), and Starlette's under 2.4 (no watch) as the floor, side by side
in one run. Each response streams a two-event body to a client that stays.

    .venv/bin/python benchmarks/event_stream.py --out benchmarks/results/event_stream.json

Each figure is the best of `--repeats` timings of `--responses` responses, in µs of this
thread's CPU on uvloop's event loop (as Serve runs its replicas).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import cpu_model, write_json  # noqa: E402
from starlette.responses import StreamingResponse  # noqa: E402

from serve_app.protocol.event_stream import EventStreamResponse  # noqa: E402

KINDS = {
    "starlette_2.3": (StreamingResponse, "2.3"),
    "event_stream_2.3": (EventStreamResponse, "2.3"),
    "starlette_2.4": (StreamingResponse, "2.4"),
}


async def per_response_us(cls, spec: str, responses: int, repeats: int) -> float:
    stays = asyncio.Event()  # never set: the client never leaves

    async def receive() -> dict:
        await stays.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        pass

    async def body():
        yield b"data: {}\n\n"
        yield b"data: [DONE]\n\n"

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}}
    for _ in range(responses // 10):  # warm-up
        await cls(body(), media_type="text/event-stream")(scope, receive, send)
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(responses):
            await cls(body(), media_type="text/event-stream")(scope, receive, send)
        best = min(best, (time.thread_time() - start) / responses)
    # Let the cancelled watchers finish before the next kind runs.
    await asyncio.sleep(0.05)
    return best * 1e6


async def measure(args) -> dict:
    return {
        kind: round(await per_response_us(cls, spec, args.responses, args.repeats), 1)
        for kind, (cls, spec) in KINDS.items()
    }


def main() -> None:
    import uvloop

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    figures = uvloop.run(measure(args))
    write_json(
        {
            "what": "µs of CPU per streamed response (a two-event body), by response class",
            "cpu": cpu_model(),
            "python": platform.python_version(),
            "checkpoint": None,
            "dtype": None,
            "threads": 1,
            "responses": args.responses,
            "us_per_response": figures,
            "saved_us_per_response": round(
                figures["starlette_2.3"] - figures["event_stream_2.3"], 1
            ),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
