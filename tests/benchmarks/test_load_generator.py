"""The benchmarks' load generator reads what a server streams, however the bytes arrive.

`serving.py`, `peer.py` and `direct_ingress.py` count tokens and time them from what
`benchmarks/load_client.py` reads off each SSE stream. It splits each socket read into events
itself, so an event cut across two reads, CRLF line ends or an event with more than one line
must not lose or invent a token.
"""

from __future__ import annotations

import asyncio
import importlib
import json

import pytest

pytestmark = pytest.mark.usefixtures("benchmark_modules")


def chunk(text: str | None = None, usage: dict | None = None) -> bytes:
    choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": None}]
    body = {"id": "cmpl-1", "object": "text_completion", "choices": choices}
    if usage:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def complete_against(handle, prompt, max_tokens: int) -> dict:
    """`stream_completion` against a one-off loopback server whose connections `handle`
    answers, on the loop the benchmarks use."""
    client = importlib.import_module("load_client")

    async def run() -> dict:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            async with client.streaming_session() as session:
                return await client.stream_completion(session, url, "m", prompt, max_tokens, {})
        finally:
            server.close()

    return client.run_client(run())


def test_events_split_across_reads_come_out_whole_and_once():
    client = importlib.import_module("load_client")
    stream = chunk("a") + chunk("b\n\nc") + b"data: [DONE]\n\n"
    for cut in range(1, len(stream)):
        got, rest = client.sse_data(stream[:cut])
        more, rest = client.sse_data(rest + stream[cut:])
        assert rest == b""
        texts = [json.loads(p)["choices"][0]["text"] for p in got + more if p != b"[DONE]"]
        assert texts == ["a", "b\n\nc"], cut  # JSON escapes the newlines inside a token
        assert (got + more)[-1] == b"[DONE]"


def test_crlf_lines_comments_and_named_events_are_read_as_sse():
    client = importlib.import_module("load_client")
    raw = b': keep-alive\r\n\r\nevent: message\r\ndata: {"x": 1}\r\n\r\ndata:{"x": 2}\n\n'
    payloads, rest = client.sse_data(raw)
    assert [json.loads(p)["x"] for p in payloads] == [1, 2]
    assert rest == b""


def test_stream_completion_counts_every_token_of_a_chunked_response():
    """A real HTTP/1.1 response with chunked transfer encoding, written in pieces that cut
    events and chunk frames anywhere; the client runs on the loop the benchmarks use."""
    texts = [f" t{i}" for i in range(40)]
    usage = {"prompt_tokens": 3, "completion_tokens": len(texts), "total_tokens": 43}
    body = b"".join(chunk(t) for t in texts) + chunk(usage=usage) + b"data: [DONE]\n\n"
    bodies: list[dict] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        bodies.append(json.loads(await reader.readexactly(length)))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        writer.write(b"x-request-id: req-7\r\ntransfer-encoding: chunked\r\n\r\n")
        for start in range(0, len(body), 37):  # chunk frames that cut events anywhere
            piece = body[start : start + 37]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.001)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    got = complete_against(handle, [1, 2, 3], 40)
    assert got["pieces"] == texts
    assert got["chunks"] == len(texts) and len(got["itl"]) == len(texts) - 1
    assert got["usage"] == usage and got["request_id"] == "req-7"
    assert got["stamps"] == sorted(got["stamps"]) and got["ttft"] > 0
    assert bodies == [
        {"model": "m", "prompt": [1, 2, 3], "max_tokens": 40, "temperature": 0, "stream": True}
    ]


def test_an_error_event_after_the_headers_raises():
    body = chunk("a") + b'data: {"error": {"message": "engine died", "type": "server_error"}}\n\n'

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    with pytest.raises(RuntimeError, match="engine died"):
        complete_against(handle, "hi", 4)
