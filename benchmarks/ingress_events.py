"""What one streamed token costs the ingress's own process, set against the floor any Python
ASGI server has: the CPU per token (one SSE event) of

- `uvicorn`: a bare ASGI app on uvicorn (uvloop, httptools) writing a fixed event per token;
- `starlette`: the same through Starlette's `StreamingResponse`;
- `ingress`: the ingress replica's real Starlette app (`Ingress.__serve_build_asgi_app__`,
  its middlewares and the proxy hold's, `/v1/completions` with `stream: true`), its engine a
  stand-in that steps every `--step-ms` and sends each request's tokens through the real
  output channel (`ChannelHub` → `EngineChannels`), as an engine replica does.

Each server runs in a process of its own on uvicorn as Serve's direct ingress runs it, with a
local Ray started in it (the ingress looks up Serve's controller; the floors start one too so
that Ray's threads are in every figure). The load generator streams `--streams` requests of
`--tokens` tokens at a time through aiohttp; a server's CPU per token is its process's
`/proc` CPU over the level divided by the tokens streamed (one SSE event each; the ingress
also ends each stream with its finish chunk). Rounds rotate the order.

    .venv/bin/python benchmarks/ingress_events.py --out benchmarks/results/ingress_events.json

No Serve machinery is in these figures: no handle call, router or gRPC stream per request
(`serving.py` measures the whole path).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import cpu_model, free_port, resolve_model, write_json  # noqa: E402
from cpu_accounting import process_cpu_seconds  # noqa: E402
from load_client import streaming_session  # noqa: E402
from peer_servers import ServerProcess  # noqa: E402

MODES = ("uvicorn", "starlette", "ingress")
# One completions chunk as the ingress frames it: what the floors write per token.
CHUNK = (
    b'data: {"id":"cmpl-0123456789abcdef","object":"text_completion","created":1700000000,'
    b'"model":"bench-llama-0","system_fingerprint":"fp","choices":[{"index":0,"text":" tok",'
    b'"logprobs":null,"finish_reason":null}]}\n\n'
)
DONE = b"data: [DONE]\n\n"


# ---------------------------------------------------------------------------- the servers


class Stepper:
    """Wakes every waiting stream once per step, as an engine step does."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.waiting: list[asyncio.Queue] = []

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            waiting, self.waiting = self.waiting, []
            for queue in waiting:
                queue.put_nowait(None)

    async def tokens(self, n: int):
        queue: asyncio.Queue = asyncio.Queue()
        for _ in range(n):
            self.waiting.append(queue)
            await queue.get()
            yield CHUNK


def floor_app(mode: str, stepper: Stepper):
    from starlette.responses import PlainTextResponse, StreamingResponse

    async def app(scope, receive, send) -> None:
        if scope["path"] == "/health":
            await PlainTextResponse("ok")(scope, receive, send)
            return
        n = int(dict(p.split("=") for p in scope["query_string"].decode().split("&"))["n"])
        if mode == "starlette":

            async def body():
                async for chunk in stepper.tokens(n):
                    yield chunk
                yield DONE

            response = StreamingResponse(body(), media_type="text/event-stream")
            await response(scope, receive, send)
            return
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        async for chunk in stepper.tokens(n):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": DONE, "more_body": False})

    return app


class _Call:
    """A Serve streaming call's generator as the ingress uses it."""

    def __init__(self, agen) -> None:
        self.agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.agen.__anext__()

    def cancel(self) -> None:
        asyncio.ensure_future(self.agen.aclose())


class _Method:
    def __init__(self, fn) -> None:
        self.remote = fn


class SteppedEngine:
    """Stands in for the engine deployment's handle: `generate` says `Routed` with the first
    output and sends every later one through the output channel, one token per request per
    step."""

    def __init__(self, step_s: float) -> None:
        from serve_app.workers.output_channel import ChannelHub

        self.step_s = step_s
        self.hub = ChannelHub("stand-in", capacity=8)
        self.active: dict[str, list] = {}
        self.generate = _Method(lambda req: _Call(self._generate(req)))
        self.channel = _Method(lambda channel_id: _Call(self.hub.serve(channel_id)))
        self.stats = _Method(self._stats)

    def options(self, **_: object) -> SteppedEngine:
        return self

    async def _stats(self) -> dict:
        return {}

    async def run(self) -> None:
        from actors.outputs import RequestOutput

        while True:
            await asyncio.sleep(self.step_s)
            for request_id, state in list(self.active.items()):
                req, made, box, done = state
                state[1] = made + 1
                last = made + 1 == req.params.max_tokens
                if last:
                    del self.active[request_id]
                out = RequestOutput(request_id, [], [_delta(made, last)], 0, last)
                await self.hub.push(box, request_id, out)
                if last:
                    done.set()

    async def _generate(self, req):
        from actors.outputs import RequestOutput
        from serve_app.workers.output_channel import Routed

        box = self.hub.attach(req.channel)
        first = RequestOutput(req.request_id, req.prompt_token_ids, [_delta(0, False)], 0, False)
        yield Routed("stand-in", box.instance if box is not None else None, first)
        if box is None:  # the ingress has no channel open yet: the rest on this call
            for i in range(1, req.params.max_tokens):
                await asyncio.sleep(self.step_s)
                last = i + 1 == req.params.max_tokens
                yield RequestOutput(req.request_id, [], [_delta(i, last)], 0, last)
            return
        done = asyncio.Event()
        self.active[req.request_id] = [req, 1, box, done]
        try:
            await done.wait()
        finally:
            self.active.pop(req.request_id, None)
            self.hub.detach(box)


def _delta(i: int, last: bool):
    from actors.outputs import CompletionDelta
    from actors.request import FinishReason

    return CompletionDelta(0, [1000 + i], " tok", None, FinishReason.LENGTH if last else None)


class _Unused:
    """The tokenizer and grammar handles: a token-id prompt without a grammar needs neither."""

    def options(self, **_: object) -> _Unused:
        return self


def ingress_app(engine: SteppedEngine, model: str | None = None):
    """Our ingress's ASGI app on `engine`, wrapped in the proxy hook's middlewares; `model`
    (the `bench` checkpoint by default) gives its tokenizer and identity."""
    from serve_app.app import served_identity
    from serve_app.backpressure import proxy_hold
    from serve_app.config.options import ServeConfig
    from serve_app.ingress import Ingress

    # As on a node whose proxy runs the hold: streams carry a flow key, writes are timed.
    os.environ[proxy_hold.CALLBACK_ENV] = proxy_hold.CALLBACK_PATH
    config = ServeConfig(model=model or resolve_model("bench").path)
    identity = served_identity(config, {"available": False})
    app = Ingress(config, _Unused(), _Unused(), engine, identity).__serve_build_asgi_app__()
    for middleware in proxy_hold.proxy_middlewares():  # Serve wraps in list order
        app = middleware.cls(app, *middleware.args, **middleware.kwargs)
    return app


def serve(mode: str, port: int, step_s: float) -> None:
    import ray
    import uvicorn

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        if mode == "ingress":
            engine = SteppedEngine(step_s)
            app, background = ingress_app(engine), engine.run
        else:
            stepper = Stepper(step_s)
            app, background = floor_app(mode, stepper), stepper.run

        async def with_lifespan(scope, receive, send) -> None:
            if scope["type"] != "lifespan":
                await app(scope, receive, send)
                return
            task = None
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    task = asyncio.get_running_loop().create_task(background())
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if task is not None:
                        task.cancel()
                    await send({"type": "lifespan.shutdown.complete"})
                    return

        uvicorn.run(
            with_lifespan,
            host="127.0.0.1",
            port=port,
            loop="uvloop",
            http="httptools",
            log_level="warning",
            access_log=False,
        )
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------------- the driver


async def level(mode: str, port: int, streams: int, requests: int, tokens: int) -> int:
    """Stream `requests` requests, `streams` at a time; the data events the clients read."""
    url = f"http://127.0.0.1:{port}"
    events = 0
    gate = asyncio.Semaphore(streams)

    async def one(session, i: int) -> None:
        nonlocal events
        async with gate:
            if mode == "ingress":
                body = {"model": "bench-llama-0", "prompt": [1, 2, 3, i % 1000 + 4]}
                body |= {"max_tokens": tokens, "stream": True, "temperature": 0}
                call = session.post(f"{url}/v1/completions", json=body)
            else:
                call = session.get(f"{url}/s?n={tokens}")
            async with call as r:
                if r.status != 200:
                    raise RuntimeError(f"{mode}: {r.status} {(await r.read())[:300]!r}")
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        events += 1

    async with streaming_session() as session:
        await asyncio.gather(*(one(session, i) for i in range(requests)))
    return events


def measure(mode: str, args) -> dict:
    port = free_port()
    argv = [sys.executable, __file__, "--serve", mode, "--port", str(port)]
    with tempfile.TemporaryDirectory() as logs:
        server = ServerProcess(
            mode, [*argv, "--step-ms", str(args.step_ms)], port, logs, {**os.environ}
        )
        try:
            server.wait_healthy(timeout_s=120)
            # Warm: the first requests import and open what later ones reuse (the channel).
            asyncio.run(level(mode, port, 8, 8, 16))
            pid = server.proc.pid
            cpu, start = process_cpu_seconds(pid), time.perf_counter()
            events = asyncio.run(level(mode, port, args.streams, args.requests, args.tokens))
            cpu, wall = process_cpu_seconds(pid) - cpu, time.perf_counter() - start
        finally:
            server.stop()  # with the local Ray it started
    # The completions stream ends each choice with a chunk of its own (its finish reason).
    expected = args.requests * (args.tokens + (mode == "ingress"))
    if events != expected:
        raise RuntimeError(f"{mode}: {events} data events read, {expected} expected")
    tokens = args.requests * args.tokens
    return {
        "mode": mode,
        "events": events,
        "seconds": round(wall, 2),
        "server_cores": round(cpu / wall, 3),
        "server_us_per_token": round(cpu / tokens * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.step_ms / 1e3)
        return
    runs = []
    for r in range(args.rounds):
        order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
        for mode in order:
            runs.append({"round": r, **measure(mode, args)})
            print(runs[-1], file=sys.stderr, flush=True)
    medians = {
        mode: statistics.median(x["server_us_per_token"] for x in runs if x["mode"] == mode)
        for mode in MODES
    }
    write_json(
        {
            "what": "server CPU per streamed token, one process each (no Serve machinery)",
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "checkpoint": "bench (the ingress's identity only; no model runs)",
            "dtype": None,
            "threads": 1,
            "streams": args.streams,
            "tokens_per_request": args.tokens,
            "requests": args.requests,
            "step_ms": args.step_ms,
            "median_server_us_per_token": medians,
            "ingress_over_starlette_us_per_token": round(
                medians["ingress"] - medians["starlette"], 1
            ),
            "runs": runs,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
