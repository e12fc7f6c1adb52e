"""Background and resumable responses over HTTP with the official client on the tiny
checkpoint: queued at once and polled to the end; cancel while running (KV back to idle)
and after the end (it stays as it ended); a streamed background response whose client left
completes anyway; a stream cut at a random event and resumed equals the uncut one."""

from __future__ import annotations

import json
import random
import time
import uuid
from typing import Any

import httpx
import openai
import pytest

from serve_app.store.base import ResponseRecord
from serve_app.store.sqlite import SQLiteStore
from tests.responses.test_responses_api import TERMINAL, create, error_of
from tests.support.generations import ORPHAN_AFTER_S, SESSION

pytestmark = pytest.mark.serve

IDLE = {"kv_blocks_used": 0, "live_requests": 0, "running": 0, "waiting": 0, "held": 0}


def poll(client: openai.OpenAI, rid: str, timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        r = client.responses.retrieve(rid)
        if r.status not in ("queued", "in_progress"):
            return r
        assert time.monotonic() < deadline, r.to_dict()
        time.sleep(0.05)


def wait_idle(admin_url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        total = httpx.get(f"{admin_url}/admin/v1/stats", timeout=10).json()["total"]
        if {k: total[k] for k in IDLE} == IDLE:
            return
        assert time.monotonic() < deadline, total
        time.sleep(0.05)


def sse_events(lines: Any) -> Any:
    """The JSON of each event's `data:` line, as it comes."""
    for line in lines:
        if line.startswith("data: "):
            yield json.loads(line[len("data: ") :])


def replay(serve_url: str, rid: str, after: int | None = None) -> list[dict]:
    params = {"stream": "true"} | ({} if after is None else {"starting_after": str(after)})
    with httpx.stream(
        "GET", f"{serve_url}/v1/responses/{rid}", params=params, timeout=60
    ) as r:  # fmt: skip
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return list(sse_events(r.iter_lines()))


def test_background_is_queued_at_once_and_polled_to_the_end(client: openai.OpenAI, model_id: str):
    r = create(client, model_id, background=True, max_output_tokens=8)
    assert r.status in ("queued", "in_progress") and r.background is True
    assert r.output == [] and r.usage is None
    final = poll(client, r.id)
    assert final.status in ("completed", "incomplete") and final.background is True
    assert final.usage.output_tokens >= 1
    # The background response chains like any other.
    second = create(client, model_id, previous_response_id=r.id, max_output_tokens=2)
    assert second.usage.input_tokens > final.usage.input_tokens


def test_background_needs_store(serve_url: str, model_id: str):
    body = {"model": model_id, "input": "hi", "background": True, "store": False}
    r = httpx.post(f"{serve_url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400
    assert (error_of(r)["code"], error_of(r)["param"]) == ("invalid_request", "background")


def test_cancel_while_running_frees_the_kv_and_keeps_the_usage(
    client: openai.OpenAI, model_id: str, serve_url: str, admin_url: str
):
    body = {"model": model_id, "input": "Tell a long story.", "background": True,
            "stream": True, "temperature": 1.0, "max_output_tokens": 200}  # fmt: skip
    with httpx.stream("POST", f"{serve_url}/v1/responses", json=body, timeout=60) as stream:
        events = sse_events(stream.iter_lines())
        seen = []
        for event in events:
            seen.append(event)
            if event["type"] == "response.output_text.delta" and len(seen) > 8:
                break
        rid = seen[0]["response"]["id"]
        cancelled = client.responses.cancel(rid)
        rest = list(events)
    assert cancelled.status == "cancelled", cancelled.to_dict()
    assert cancelled.usage.output_tokens >= 1 and cancelled.usage.input_tokens > 0
    assert rest[-1]["type"] == "response.cancelled"
    assert [e["sequence_number"] for e in seen + rest] == list(range(len(seen + rest)))
    wait_idle(admin_url)
    # Idempotent: a second cancel answers the same ended response.
    assert client.responses.cancel(rid).to_dict() == cancelled.to_dict()
    assert client.responses.retrieve(rid).status == "cancelled"


def test_a_finished_response_stays_finished_when_cancelled(client: openai.OpenAI, model_id: str):
    r = create(client, model_id, max_output_tokens=2)
    after = client.responses.cancel(r.id)
    assert after.status == r.status and after.to_dict() == r.to_dict()
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_never")


def test_a_streamed_stored_response_outlives_its_client(client: openai.OpenAI, model_id: str):
    for background in (True, False):
        stream = create(client, model_id, stream=True, background=background,
                        max_output_tokens=24, temperature=0.0)  # fmt: skip
        first = next(iter(stream))
        stream.close()  # the client leaves after the first event
        final = poll(client, first.response.id)
        assert final.status in ("completed", "incomplete"), final.to_dict()
        assert final.usage.output_tokens >= 1


def test_a_stream_cut_at_a_random_event_and_resumed_equals_the_uncut_one(
    client: openai.OpenAI, model_id: str, serve_url: str
):
    body = {"model": model_id, "input": "Count to ten.", "stream": True,
            "max_output_tokens": 24, "temperature": 0.0}  # fmt: skip
    cut = random.Random().randint(0, 8)
    with httpx.stream("POST", f"{serve_url}/v1/responses", json=body, timeout=60) as stream:
        head = []
        for event in sse_events(stream.iter_lines()):
            head.append(event)
            if len(head) > cut:
                break
    rid = head[0]["response"]["id"]
    tail = replay(serve_url, rid, head[-1]["sequence_number"])
    whole = head + tail
    assert [e["sequence_number"] for e in whole] == list(range(len(whole)))
    assert whole[-1]["type"] in TERMINAL
    # The uncut stream of the same response, replayed from the store, is event for event
    # the same; an uncut greedy run of the same request makes the same text.
    assert replay(serve_url, rid) == whole
    uncut = create(client, model_id, input="Count to ten.", max_output_tokens=24,
                   temperature=0.0)  # fmt: skip
    text = "".join(e["delta"] for e in whole if e["type"] == "response.output_text.delta")
    assert text == uncut.output_text


def test_resume_names_its_position(serve_url: str, client: openai.OpenAI, model_id: str):
    r = create(client, model_id, max_output_tokens=2)
    params = {"stream": "true", "starting_after": "x"}
    bad = httpx.get(f"{serve_url}/v1/responses/{r.id}", params=params, timeout=30)
    assert bad.status_code == 400 and error_of(bad)["param"] == "starting_after"
    # Past the end: nothing more to send.
    assert replay(serve_url, r.id, 10_000) == []


def session_store() -> SQLiteStore:
    """A second store on the session server's SQLite file: what a restarted server opens."""
    return SQLiteStore(SESSION["data_dir"] / "serve-app.sqlite3")


def test_the_store_holds_the_events_written_in_batches(client: openai.OpenAI, model_id: str):
    events = list(create(client, model_id, stream=True, max_output_tokens=48, temperature=0.0))
    store = session_store()
    try:
        record = store.get_response("default", events[0].response.id)
        stored = store.get_response_events("default", events[0].response.id, -1)
    finally:
        store.close()
    assert [e["sequence_number"] for e in stored] == list(range(len(events)))
    assert stored[-1]["response"] == record.data["response"]
    # Fewer writes than events: one insert, a batch per 64 events or half second, the end.
    assert record.data["store_writes"] < len(events)


def test_a_response_whose_process_is_gone_resumes_to_failed_engine_lost(
    client: openai.OpenAI, model_id: str, serve_url: str
):
    rid = f"resp_{uuid.uuid4().hex}"
    now = time.time()
    made = create(client, model_id, max_output_tokens=2).to_dict()
    running = {**made, "id": rid, "status": "in_progress", "output": [], "usage": None}
    created = {"type": "response.created", "response": running, "sequence_number": 0}
    # Written as the previous revision did: its events inside the record.
    data = {"response": running, "input_items": [], "context": [], "events": [created],
            "written_at": now - ORPHAN_AFTER_S * 10}  # fmt: skip
    store = session_store()
    try:
        store.insert_response(ResponseRecord(rid, "default", "in_progress", data, now, now + 600))
    finally:
        store.close()
    events = replay(serve_url, rid, 0)
    assert [e["type"] for e in events] == ["response.failed"]
    assert events[0]["sequence_number"] == 1
    assert events[0]["response"]["error"]["code"] == "engine_lost"
    final = client.responses.retrieve(rid)
    assert final.status == "failed" and final.error.code == "engine_lost"
    # Ended for good: a cancel leaves it as it ended.
    assert client.responses.cancel(rid).status == "failed"


def test_an_idempotency_key_replays_the_json_response(serve_url: str, model_id: str):
    key = f"k-{uuid.uuid4().hex}"
    body = {"model": model_id, "input": "hi", "max_output_tokens": 4, "temperature": 0.0}

    def post(**extra: Any) -> httpx.Response:
        return httpx.post(f"{serve_url}/v1/responses", json={**body, **extra}, timeout=60,
                          headers={"Idempotency-Key": key})  # fmt: skip

    first = post(stream=True)
    assert first.headers["content-type"].startswith("text/event-stream")
    created = json.loads(first.text.split("data: ", 2)[1].split("\n", 1)[0])
    # A repeat of a streamed request gets the JSON resource, never a new run nor a stream.
    again = post(stream=True)
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.headers["content-type"].startswith("application/json")
    assert again.json()["id"] == created["response"]["id"]
    assert again.json()["status"] in ("completed", "incomplete")
    other = post(max_output_tokens=5)
    assert other.status_code == 409 and error_of(other)["code"] == "idempotency_key_reused"
    assert other.headers["x-should-retry"] == "false"
