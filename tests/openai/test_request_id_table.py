"""The ingress's X-Request-Id table on its own: a completed id replays for its retention and is
forgotten after it, in the order ids completed, without a purge touching the others."""

from __future__ import annotations

import asyncio

import pytest
from starlette.responses import JSONResponse

from serve_app import errors
from serve_app.openai.request_ids import RequestIds
from tests.support.clock import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


def complete(ids: RequestIds, rid: str, body: bytes | dict = b'{"prompt": "a"}', text: str = "x"):
    """One non-streamed attempt of `rid` that completes with `text`; the response it got."""

    async def handler(record):
        record({"text": text})
        return JSONResponse({"text": text})

    return asyncio.run(ids.guard(rid, "tenant", body, False, False, handler))


def test_a_completed_id_replays_until_its_retention_passes_then_runs_again(clock):
    ids = RequestIds(retention_s=60, clock=clock)
    assert complete(ids, "a", text="first").headers.get("x-replayed") is None
    clock.now += 59
    assert complete(ids, "a", text="second").headers["x-replayed"] == "true"
    clock.now += 1
    again = complete(ids, "a", text="third")
    assert again.headers.get("x-replayed") is None and again.body == b'{"text":"third"}'
    # The new attempt's record has its own retention, counted from its completion.
    clock.now += 59
    assert complete(ids, "a", body=b'{"prompt": "a"}').body == b'{"text":"third"}'


def test_ids_are_forgotten_in_the_order_they_completed(clock):
    ids = RequestIds(retention_s=10, clock=clock)
    for i in range(100):
        complete(ids, f"r{i}")
        clock.now += 0.1
    assert len(ids.records) == 100
    clock.now = 1000.0 + 10 + 4.95  # r0 .. r49 completed 10 s or more ago
    ids._purge()
    assert sorted(ids.records) == sorted(("tenant", f"r{i}") for i in range(50, 100))
    # Only expired entries were looked at: the queue holds exactly the records still kept.
    assert [key for _, key in ids._expiry] == [("tenant", f"r{i}") for i in range(50, 100)]


def test_a_live_attempt_is_never_purged_and_a_different_body_conflicts(clock):
    ids = RequestIds(retention_s=1, clock=clock)
    started = asyncio.Event()

    async def run():
        async def slow(record):
            started.set()
            await asyncio.sleep(0.05)
            record({"text": "done"})
            return JSONResponse({"text": "done"})

        live = asyncio.create_task(ids.guard("b", "tenant", b"{}", False, False, slow))
        await started.wait()
        clock.now += 100
        ids._purge()
        with pytest.raises(errors.APIError) as busy:
            await ids.guard("b", "tenant", b"{}", False, False, slow)
        assert busy.value.status == 409
        await live

    asyncio.run(run())
    with pytest.raises(errors.APIError) as other:
        complete(ids, "b", body=b'{"prompt": "other"}')
    assert other.value.status == 409


def test_a_retry_is_the_same_request_whatever_its_spelling_or_form(clock):
    """The record compares bodies as JSON: key order and spacing do not make a new request,
    the endpoint's already-parsed body is recorded as its bytes would be, any value counts
    (an integer beyond 64 bits too) and bytes that are not JSON still identify themselves."""
    ids = RequestIds(retention_s=60, clock=clock)
    body = {"prompt": [1, 2, 3], "max_tokens": 8, "stop": ["é", "\u2028"], "n": 2**70}
    complete(ids, "a", body=body, text="first")  # as routes.py hands it over: parsed
    spelled = b'{ "n": 1180591620717411303424, "stop": ["\\u00e9", "\\u2028"],\n'
    spelled += b' "max_tokens": 8, "prompt": [1, 2, 3] }'
    again = complete(ids, "a", body=spelled, text="second")
    assert again.headers["x-replayed"] == "true" and again.body == b'{"text":"first"}'
    with pytest.raises(errors.APIError, match="different body"):
        complete(ids, "a", body={**body, "n": 2**70 + 1})

    complete(ids, "b", body=b"not json", text="raw")
    assert complete(ids, "b", body=b"not json").body == b'{"text":"raw"}'
    with pytest.raises(errors.APIError, match="different body"):
        complete(ids, "b", body=b"not json either")
