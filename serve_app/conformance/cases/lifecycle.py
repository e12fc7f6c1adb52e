"""A request's life: cancellation (KV back to baseline), a slow consumer held then resumed, a
duplicate live id, a retry after completion."""

from __future__ import annotations

import json
import socket
import time
import uuid
from typing import Any

import httpx

from serve_app.conformance.cases.base import (
    case,
    chat_body,
    completion_body,
    long_output,
    raw_post,
    raw_stream,
)
from serve_app.conformance.cases.errors import expect_error
from serve_app.conformance.observe import stream_generations
from serve_app.conformance.record import CaseRecord
from serve_app.conformance.session import DONE, Session

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# Back to the KV baseline within this after a disconnect (docs/operations.md measures ~50 ms).
RELEASE_WITHIN_S = 5.0


def _idle(stats: dict[str, Any]) -> bool:
    return stats.get("live_requests", 0) == 0 and stats.get("running", 0) == 0


@case("cancellation", "a client that leaves mid-stream is cancelled: KV back to baseline")
def cancellation(s: Session, record: CaseRecord) -> None:
    body = long_output(s, completion_body(s, "A very long story:", temperature=0), 400)
    baseline = None
    if s.target.admin_url:
        idle, _, baseline = s.wait_admin(_idle, 10)
        if not idle:
            record.unsupported("the server is not idle: a baseline cannot be read", baseline)
    record.inputs["request"] = {**body, "stream": True}
    live = s.open_stream(COMPLETIONS, {**body, "stream": True})
    if live.stream.status != 200:
        record.fail(f"HTTP {live.stream.status}: {live.stream.body}")
    record.observation["outputs_before_leaving"] = live.read_outputs(3)
    if baseline is not None:
        # Live first (the replicas push their stats every ~0.2 s): the case tests a release.
        seen, _, during = s.wait_admin(lambda t: t.get("live_requests", 0) >= 1, 5)
        record.notes["during"] = during
        record.check(seen, f"the stream was never seen live in the admin stats: {during}")
    live.close()
    if baseline is None:
        after = raw_post(s, record, "after", COMPLETIONS, completion_body(s, "hi", max_tokens=1))
        record.check(after[0] == 200, f"the next request: HTTP {after[0]}")
        record.unsupported("needs --admin-url to see the KV blocks return to baseline")

    def released(stats: dict[str, Any]) -> bool:
        return _idle(stats) and stats.get("kv_blocks_used") == baseline.get("kv_blocks_used")

    ok, seconds, last = s.wait_admin(released, RELEASE_WITHIN_S)
    record.timings["released_after_s"] = round(seconds, 3)
    record.notes.update(baseline=baseline, after=last)
    record.check(ok, f"not back to baseline {RELEASE_WITHIN_S} s after the disconnect: {last}")
    record.observation["back_to_baseline"] = ok


# The least time a stalled reader is given to be held (more on a slow model, see the case).
HELD_WITHIN_S = 20.0


@case(
    "slow-consumer",
    "a client that stops reading is held (KV kept), then resumes with its whole stream",
    fast=False,
)
def slow_consumer(s: Session, record: CaseRecord) -> None:
    tokens = min(900, (s.max_model_len or 1024) - 64)
    body = long_output(s, completion_body(s, "Tell me a long story", temperature=0), tokens)
    reference = raw_stream(s, record, "reference", COMPLETIONS, body)
    expected = stream_generations(reference, greedy=True, chat=False)[0]
    stalled = StalledClient(s.target.root, COMPLETIONS, {**body, "stream": True}, s.http.headers)
    try:
        record.check(stalled.head.startswith("http/1.1 200"), f"head {stalled.head[:40]!r}")
        held = None
        if s.target.admin_url:
            # The hold comes once the buffers between engine and socket fill, so its time goes
            # with the model's speed: bounded by how long the whole stream took unstalled.
            within = max(HELD_WITHIN_S, 1.5 * reference.total_s)
            record.timings["held_within_s"] = round(within, 3)
            held, seconds, _ = s.wait_admin(lambda t: t.get("held", 0) >= 1, within)
            record.timings["held_after_s"] = round(seconds, 3)
            record.check(held, "the stalled client was never held (admin stats)")
        else:
            time.sleep(3)
        record.observation["held"] = held
        events = stalled.read_to_end()
    finally:
        stalled.close()
    chunks = [json.loads(e) for e in events if e != DONE]
    text = "".join(c["choices"][0].get("text") or "" for c in chunks if c.get("choices"))
    finish = next(
        (c["choices"][0]["finish_reason"] for c in reversed(chunks)
         if c.get("choices") and c["choices"][0].get("finish_reason")),
        None,
    )  # fmt: skip
    record.outputs["generation"] = {**expected, "greedy": True}
    record.check(events[-1:] == [DONE], "the resumed stream does not end with [DONE]")
    record.check(
        text == expected["text"], "the resumed stream's text differs from an unstalled run"
    )
    record.check(finish == expected["finish_reason"], f"finish_reason {finish!r}")
    record.observation["resumed_whole"] = text == expected["text"]


class StalledClient:
    """A raw HTTP/1.1 client with a small receive buffer that reads the response head and
    then nothing, until asked to read to the end."""

    def __init__(self, root: str, path: str, payload: dict, headers: httpx.Headers):
        url = httpx.URL(root)
        family, kind, proto, _, address = socket.getaddrinfo(
            url.host, url.port or 80, type=socket.SOCK_STREAM
        )[0]
        self.sock = socket.socket(family, kind, proto)
        # Before connecting (tcp(7)): the window scale is agreed in the handshake, and a
        # buffer shrunk afterwards cannot hold the window already advertised: the server's
        # segments past it are dropped and its retransmissions back off while the client
        # stalls, so the first byte came up to tens of seconds after it read again.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(60)
        self.sock.connect(address)
        data = json.dumps(payload).encode()
        auth = headers.get("authorization")
        extra = f"Authorization: {auth}\r\n" if auth else ""
        self.sock.sendall(
            f"POST {url.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {url.host}\r\n{extra}"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        raw = b""
        while b"\r\n\r\n" not in raw:
            raw += self.sock.recv(1024)
        head, _, self._rest = raw.partition(b"\r\n\r\n")
        self.head = head.decode("latin-1").lower()

    def read_to_end(self) -> list[str]:
        raw = self._rest
        while not raw.endswith(b"0\r\n\r\n"):
            more = self.sock.recv(65536)
            if not more:
                break
            raw += more
        payload = _dechunk(raw) if "transfer-encoding: chunked" in self.head else raw
        return [
            line[len("data: ") :]
            for line in payload.decode("utf-8", "replace").splitlines()
            if line.startswith("data: ")
        ]

    def close(self) -> None:
        self.sock.close()


def _dechunk(raw: bytes) -> bytes:
    out, pos = b"", 0
    while pos < len(raw):
        eol = raw.index(b"\r\n", pos)
        size = int(raw[pos:eol].split(b";")[0], 16)
        if size == 0:
            break
        out += raw[eol + 2 : eol + 2 + size]
        pos = eol + 2 + size + 2
    return out


@case(
    "duplicate-live-id",
    "a second request under a live X-Request-Id is 409 request_id_in_use; the first goes on",
)
def duplicate_live_id(s: Session, record: CaseRecord) -> None:
    rid = f"conformance-{uuid.uuid4().hex}"
    record.notes["request_id"] = rid
    headers = {"X-Request-Id": rid}
    body = {
        **long_output(s, chat_body(s, "Tell a long story.", temperature=0), 200),
        "stream": True,
    }
    record.inputs["first"] = body
    first = s.open_stream(CHAT, body, headers)
    try:
        if first.stream.status != 200:
            record.fail(f"the first request: HTTP {first.stream.status}")
        first.read_outputs(1)
        answer = raw_post(s, record, "second", CHAT, body, headers)
        if answer[0] == 200:
            record.unsupported("a second live request under one X-Request-Id was served")
        expect_error(record, "error", answer, 409, ("request_id_in_use",))
        stream = first.read_rest()
    finally:
        first.close()
    finished = [g["finish_reason"] for g in stream_generations(stream, greedy=True, chat=True)]
    record.check(stream.done, "the first request's stream did not end with [DONE]")
    record.check(finished in (["length"], ["stop"]), f"the first request finished {finished}")


@case(
    "retry-after-completion",
    "the same X-Request-Id and body after completion returns the recorded result; "
    "another body is 409",
)
def retry_after_completion(s: Session, record: CaseRecord) -> None:
    rid = f"conformance-{uuid.uuid4().hex}"
    record.notes["request_id"] = rid
    headers = {"X-Request-Id": rid}
    body = completion_body(s, "Replay me:", max_tokens=8, temperature=1.0)
    first = raw_post(s, record, "first", COMPLETIONS, body, headers)
    if first[0] != 200:
        record.fail(f"the first request: HTTP {first[0]}")
    again = raw_post(s, record, "retry", COMPLETIONS, body, headers)
    if again[0] == 200 and again[2] != first[2]:
        record.unsupported("a retry under a completed X-Request-Id generated again (not replayed)")
    record.check(again[0] == 200, f"the retry: HTTP {again[0]}")
    record.check(again[2] == first[2], "the retry's answer is not the recorded one")
    record.notes["replayed_header"] = again[1].get("x-replayed")
    other = raw_post(s, record, "other_body", COMPLETIONS, {**body, "prompt": "Other"}, headers)
    expect_error(record, "other_body_error", other, 409, ("request_id_in_use",))
    record.observation["replayed"] = again[2] == first[2]
