"""One output loop for both response modes: the SSE stream and the JSON body read the same
engine outputs into the same choices, end open choices at the deadline the same way, and an
engine failure is an error frame once streaming and a 500 before."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from actors.outputs import CompletionDelta, RequestOutput
from actors.request import FinishReason
from serve_app import errors
from serve_app.openai.admission import AdmittedRequest
from serve_app.openai.format import Formatter
from serve_app.openai.stream import collect_body, stream_sse
from serve_app.protocol import parse_request

MESSAGES = [{"role": "user", "content": "hi"}]


def job(n: int = 2, stream: bool = False) -> AdmittedRequest:
    body = {"model": "m", "messages": MESSAGES, "n": n, "stream": stream}
    req = parse_request("chat", body)
    fmt = Formatter(
        chat=True, response_id="chatcmpl-1", model="m", fingerprint="fp", texts=None,
        want_logprobs=False, prompt_ids=[[1, 2, 3]], n=n,
    )  # fmt: skip
    engine_request = SimpleNamespace(prompt_token_ids=[1, 2, 3])
    return AdmittedRequest(req, fmt, [engine_request], [""], n, None)


def out(*deltas: CompletionDelta, error: str | None = None) -> RequestOutput:
    finished = bool(deltas) and all(d.finished for d in deltas)
    return RequestOutput("r", [1, 2, 3], list(deltas), 2, finished, error=error)


async def merged(items):
    """One output per pull (a writer that keeps up); the deadline as the engine loop sends it."""
    for item in items:
        yield [(-1, None)] if item is None else [(0, item)]


OUTPUTS = [
    out(CompletionDelta(0, [5], "Hel"), CompletionDelta(1, [7], "Bye")),
    out(CompletionDelta(0, [6], "lo", finish_reason=FinishReason.STOP, stop_reason=None)),
    None,  # the deadline passes with choice 1 still open
]


def run_stream(items) -> list[dict | str]:
    async def go():
        return [frame async for frame in stream_sse(merged(items), job(stream=True))]

    frames = []
    for raw in asyncio.run(go()):
        data = raw.decode().removeprefix("data: ").strip()
        frames.append(data if data == "[DONE]" else json.loads(data))
    return frames


def test_the_stream_and_the_body_tell_the_same_story():
    body = asyncio.run(collect_body(merged(OUTPUTS), job()))
    frames = run_stream(OUTPUTS)
    assert frames[-1] == "[DONE]"
    texts = {0: "", 1: ""}
    finish = {}
    for frame in frames[:-1]:
        for choice in frame["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
    by_index = {c["index"]: c for c in body["choices"]}
    assert {i: c["message"]["content"] for i, c in by_index.items()} == texts
    assert texts == {0: "Hello", 1: "Bye"}
    assert {i: c["finish_reason"] for i, c in by_index.items()} == finish
    assert finish == {0: "stop", 1: "timeout"}
    assert body["usage"]["completion_tokens"] == 3


def test_an_engine_failure_is_an_error_frame_once_streaming_and_a_500_before():
    failing = [out(CompletionDelta(0, [5], "Hel")), out(error="worker lost")]
    frames = run_stream(failing)
    assert frames[-2]["error"]["code"] == "internal_error" and frames[-1] == "[DONE]"
    with pytest.raises(errors.APIError) as info:
        asyncio.run(collect_body(merged(failing), job()))
    assert info.value.status == 500 and "worker lost" in info.value.message


def test_a_lost_engine_is_named_in_the_error_frame_and_the_500():
    """The engine's own error code reaches the client, stream or not (the error table's
    internal class: `engine_lost`, a server_error the client should not repeat)."""
    lost = out(error="the engine replica was lost")
    lost.error_code = "engine_lost"
    failing = [out(CompletionDelta(0, [5], "Hel")), lost]
    frames = run_stream(failing)
    assert frames[-1] == "[DONE]"
    assert frames[-2]["error"]["code"] == "engine_lost"
    assert frames[-2]["error"]["type"] == "server_error"
    assert "the engine replica was lost" in frames[-2]["error"]["message"]
    with pytest.raises(errors.APIError) as info:
        asyncio.run(collect_body(merged(failing), job()))
    assert (info.value.status, info.value.code) == (500, "engine_lost")
    assert info.value.headers["x-should-retry"] == "false"
