"""The benchmarks' HTTP load generator: closed-loop clients streaming `/v1/completions` over
aiohttp on uvloop, each SSE event read, stamped and counted as it arrives. It runs on the same
cores as the server it measures, so it is kept lean (`serving.py` reports its CPU per token),
and `serving.py`, `peer.py`, `direct_ingress.py`, `responses.py` and `ingress_events.py` share
it: every side of a comparison is read by the same client."""

from __future__ import annotations

import time

from common import percentile


async def closed_loop(items: list, concurrency: int, send) -> tuple[list[dict], float]:
    """`await send(item)` for every item through `concurrency` closed-loop clients, in
    order; the results and the wall time."""
    import asyncio

    queue = list(items)
    results: list[dict] = []

    async def worker() -> None:
        while queue:
            results.append(await send(queue.pop(0)))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


def streaming_session(timeout_s: float = 900):
    """The load generator's HTTP client: aiohttp (its HTTP parser is C; vLLM's serving benchmark
    uses it too). It runs on the server's own cores, so what it costs per token is taken from
    the engine: httpx's pure-Python stream parsing cost about 0.1-0.14 ms of CPU per token, as
    much as the serving path itself (serving.py reports `client_cpu_ms_per_token`). Run it
    with `run_client`."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=timeout_s)
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))


def run_client(coro):
    """`asyncio.run(coro)` on uvloop, the loop Ray runs the served replicas on. With the event
    reading of `stream_completion`, the load generator's CPU per streamed token at 64 streams
    fell from 0.029 to 0.020 ms (`bench`, direct ingress, 4 alternating levels each in one
    server): CPU the engine's threads on the same cores would otherwise lose."""
    import asyncio

    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def sse_data(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The `data:` payloads of the complete events in `buffer` (events end with a blank line,
    lines with LF or CRLF), and the incomplete rest to prepend to the next read."""
    if b"\r" in buffer:
        buffer = buffer.replace(b"\r\n", b"\n")
    *events, rest = buffer.split(b"\n\n")
    payloads = []
    for event in events:
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                payloads.append(line[6:] if line.startswith(b"data: ") else line[5:])
    return payloads, rest


async def stream_completion(
    session, url: str, model: str, prompt, max_tokens: int, extra: dict
) -> dict:
    """One greedy streamed `/v1/completions` request (`extra` merged into its body), its SSE
    events read as they come: TTFT and the gaps between events that carry text (`itl`), the
    arrival time and text of each (`stamps`, `pieces`), the usage event and the server's
    request id. An error event (a failure after the headers went out) raises. Each read from
    the socket is split into events here (`sse_data`) rather than line by line through
    aiohttp's reader, and the events of one read share its arrival time."""
    import orjson

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
    body |= {"temperature": 0, "stream": True, **extra}
    start = time.perf_counter()
    stamps: list[float] = []
    pieces: list[str] = []
    usage: dict | None = None
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status} {(await r.read())[:500]!r}")
        request_id = r.headers.get("x-request-id", "")
        rest = b""
        async for data in r.content.iter_any():
            now = time.perf_counter()
            payloads, rest = sse_data(rest + data)
            for payload in payloads:
                if payload == b"[DONE]":
                    continue
                chunk = orjson.loads(payload)
                if "error" in chunk:
                    raise RuntimeError(f"{url}: error frame {chunk['error']}")
                usage = chunk.get("usage") or usage
                choices = chunk.get("choices")
                text = choices[0].get("text") if choices else None
                if text:
                    stamps.append(now)
                    pieces.append(text)
    first = stamps[0] if stamps else time.perf_counter()
    return {
        "ttft": first - start,
        "itl": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
        "stamps": stamps,
        "pieces": pieces,
        "chunks": len(pieces),
        "usage": usage,
        "request_id": request_id,
    }


def stream_summary(results: list[dict], seconds: float) -> dict:
    """Throughput and latency percentiles of streamed requests, each a dict with `ttft`
    (s), `itl` (list of s) and `tokens`."""
    ttft = [r["ttft"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    return {
        "requests": len(results),
        "output_tokens": tokens,
        "seconds": seconds,
        "output_tok_s": tokens / seconds,
        "ttft_ms": {"p50": percentile(ttft, 50) * 1e3, "p99": percentile(ttft, 99) * 1e3},
        "itl_ms": {"p50": percentile(itl, 50) * 1e3, "p99": percentile(itl, 99) * 1e3},
    }
