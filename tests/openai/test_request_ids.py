"""X-Request-Id over HTTP: one live attempt per id, replay after completion, 409s."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

pytestmark = pytest.mark.serve


def test_an_id_is_generated_when_none_is_given(serve_url, model_id):
    r = httpx.post(
        f"{serve_url}/v1/completions", json={"model": model_id, "prompt": "a", "max_tokens": 2}
    )
    assert r.status_code == 200 and len(r.headers["x-request-id"]) >= 16


def test_completed_id_replays_without_generating_again(serve_url, model_id):
    rid = uuid.uuid4().hex
    body = {"model": model_id, "prompt": "replay me", "max_tokens": 8, "temperature": 1.0}
    first = httpx.post(f"{serve_url}/v1/completions", json=body, headers={"X-Request-Id": rid})
    assert first.status_code == 200 and first.headers["x-request-id"] == rid
    again = httpx.post(f"{serve_url}/v1/completions", json=body, headers={"X-Request-Id": rid})
    assert again.status_code == 200 and again.headers.get("x-replayed") == "true"
    # The recorded answer itself: same random completion id, same text sampled at T=1.
    assert again.json() == first.json()
    with httpx.stream(
        "POST",
        f"{serve_url}/v1/completions",
        json={**body, "stream": True},
        headers={"X-Request-Id": rid},
    ) as r:
        # A streaming body differs from the recorded one: it is a different request.
        assert r.status_code == 409
    other = httpx.post(
        f"{serve_url}/v1/completions",
        json={**body, "prompt": "changed"},
        headers={"X-Request-Id": rid},
    )
    assert other.status_code == 409 and other.json()["error"]["code"] == "request_id_in_use"
    assert other.headers["x-should-retry"] == "false"


def test_streamed_request_replays_as_a_stream(serve_url, model_id):
    rid = uuid.uuid4().hex
    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }

    def read() -> tuple[str, list]:
        events = []
        with httpx.stream(
            "POST", f"{serve_url}/v1/chat/completions", json=body, headers={"X-Request-Id": rid}
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        text = "".join(
            c["delta"].get("content") or "" for e in events[:-1] for c in json.loads(e)["choices"]
        )
        return text, events

    def token_ids(events: list) -> tuple[list, list]:
        chunks = [json.loads(e) for e in events[:-1]]
        ids = [t for chunk in chunks for c in chunk["choices"] for t in c.get("token_ids", [])]
        return chunks[0]["prompt_token_ids"], ids

    text, events = read()
    replay_text, replay_events = read()
    assert replay_text == text and replay_events[-1] == "[DONE]"
    # The replay carries the recorded ids as the live stream did (`return_token_ids`).
    prompt_ids, ids = token_ids(events)
    assert token_ids(replay_events) == (prompt_ids, ids) and len(ids) == 6 and prompt_ids
    usage = json.loads(replay_events[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6


def test_live_id_conflicts_and_a_cancelled_attempt_frees_it(serve_url, model_id):
    rid = uuid.uuid4().hex
    long = {
        "model": model_id,
        "prompt": "long",
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{serve_url}/v1/completions", json=long, headers={"X-Request-Id": rid}
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)  # the attempt is live and streaming
        dup = httpx.post(
            f"{serve_url}/v1/completions", json=long, headers={"X-Request-Id": rid}, timeout=30
        )
        assert dup.status_code == 409 and dup.json()["error"]["code"] == "request_id_in_use"
    # The client left mid-stream: once the server has seen it go, that attempt is cancelled
    # and the id starts a new one (until then the attempt is still live: 409, as above).
    short = {**long, "max_tokens": 3, "stream": False}
    deadline = time.monotonic() + 10
    while True:
        retry = httpx.post(
            f"{serve_url}/v1/completions", json=short, headers={"X-Request-Id": rid}, timeout=30
        )
        if retry.status_code != 409 or time.monotonic() > deadline:
            break
        assert retry.json()["error"]["code"] == "request_id_in_use"
        time.sleep(0.05)
    assert retry.status_code == 200 and retry.json()["usage"]["completion_tokens"] == 3
