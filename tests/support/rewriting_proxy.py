"""A deliberately changed server: a loopback proxy in front of a real one that rewrites what
passes through (request bodies, JSON answers, whole SSE streams), so the conformance diff can be
tested on records of servers that differ in one known way."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import httpx

from tests.support.ports import free_port

Json = Any


@dataclass
class Rewrite:
    """What the proxy changes; each hook gets the request path and returns the new value."""

    request: Callable[[str, Json], Json] | None = None
    answer: Callable[[str, int, Json], Json] | None = None
    # A whole stream's events (JSON chunks, and "[DONE]") -> the events to send.
    stream: Callable[[str, list[Json]], list[Json]] | None = None


@contextmanager
def rewriting_proxy(upstream: str, rewrite: Rewrite) -> Iterator[str]:
    """The proxy's URL while the block runs (uvicorn in a thread, stopped on the way out)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    client = httpx.AsyncClient(base_url=upstream, timeout=120)

    async def forward(request: Request) -> Response:
        path = request.url.path
        body = await request.body()
        if body and rewrite.request is not None:
            with suppress(ValueError):  # not JSON: sent as it came
                body = json.dumps(rewrite.request(path, json.loads(body))).encode()
        headers = {k: v for k, v in request.headers.items() if k not in ("host", "content-length")}
        url = path + (f"?{request.url.query}" if request.url.query else "")
        r = await client.request(request.method, url, content=body, headers=headers)
        out_headers = {
            k: v
            for k, v in r.headers.items()
            if k not in ("content-length", "transfer-encoding", "content-encoding", "connection")
        }
        content = r.content
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            content = _rewrite_stream(path, r.text, rewrite.stream)
        elif rewrite.answer is not None:
            with suppress(ValueError):
                content = json.dumps(rewrite.answer(path, r.status_code, r.json())).encode()
        return Response(content, status_code=r.status_code, headers=out_headers)

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH"]
    app = Starlette(routes=[Route("/{path:path}", forward, methods=methods)])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            threading.Event().wait(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        asyncio.run(client.aclose())


def _rewrite_stream(path: str, text: str, hook) -> bytes:
    events: list[Json] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    if hook is not None:
        events = hook(path, events)
    out = "".join(
        f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events
    )  # fmt: skip
    return out.encode()


# ------------------------------------------------------------------ rewrites


def walk_logprobs(value: Json, delta: float) -> Json:
    """Every logprob in an answer moved by `delta` (chat and completions shapes)."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key == "logprob" and isinstance(item, int | float):
                out[key] = item + delta
            elif key == "token_logprobs" and isinstance(item, list):
                out[key] = [v + delta if isinstance(v, int | float) else v for v in item]
            elif (
                key == "top_logprobs"
                and isinstance(item, list)
                and item
                and isinstance(item[0], dict)
                and "logprob" not in item[0]
            ):
                out[key] = [{t: v + delta for t, v in d.items()} if d else d for d in item]
            else:
                out[key] = walk_logprobs(item, delta)
        return out
    if isinstance(value, list):
        return [walk_logprobs(v, delta) for v in value]
    return value
