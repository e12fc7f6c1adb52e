"""The engine timelines behind `GET /admin/v1/requests/{id}`: a replica's ring records each
engine request as it ends, hands the new ones to its reporter once, and the registry's index
finds a request by either id on any replica, keeping a bounded number of each."""

from __future__ import annotations

import asyncio
import time

from actors.messages import EngineRequest
from actors.outputs import CompletionDelta, RequestOutput
from actors.request import FinishReason
from actors.sampling_params import SamplingParams
from serve_app.ops.timelines import TimelineIndex, TimelineRing


def engine_request(request_id: str, grammar: bool = False) -> EngineRequest:
    box = [object()] if grammar else None
    return EngineRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=2), grammar=box)


async def two_tokens():
    yield RequestOutput("e1", [1, 2, 3], [CompletionDelta(0, [7], "a")], 1, False)
    timeline = {"scheduled_s": 0.01, "grammar_ready_s": 0.5, "first_token_s": 0.52}
    last = CompletionDelta(0, [8], "b", finish_reason=FinishReason.LENGTH)
    yield RequestOutput("e1", [1, 2, 3], [last], 1, True, timeline=timeline)


async def drain(ring: TimelineRing, request: EngineRequest, outputs, leave_after: int = 99):
    seen = []
    gen = ring.watch(request, outputs)
    async for out in gen:
        seen.append(out)
        if len(seen) == leave_after:
            await gen.aclose()  # the reader leaves early
            break
    return seen


def test_ring_records_a_finished_request_once_and_finds_it_by_engine_id():
    ring = TimelineRing("replica-a")
    seen = asyncio.run(drain(ring, engine_request("e1", grammar=True), two_tokens()))
    assert len(seen) == 2  # outputs pass through unchanged
    (entry,) = ring.lookup("e1")
    assert entry["replica"] == "replica-a" and entry["has_grammar"] and entry["finished"]
    assert (entry["num_prompt_tokens"], entry["num_output_tokens"]) == (3, 2)
    assert entry["num_cached_tokens"] == 1 and entry["finish_reason"] == "length"
    timeline = entry["timeline"]
    assert timeline["arrival_s"] == 0.0 and timeline["grammar_ready_s"] == 0.5
    assert timeline["scheduled_s"] < timeline["grammar_ready_s"] < timeline["first_token_s"]
    assert timeline["finished_s"] >= 0
    assert ring.take_new() == [entry] and ring.take_new() == []
    assert ring.lookup("unknown") == []


def test_the_engines_arrival_is_placed_on_the_replicas_clock():
    async def taken_after_the_step_in_progress():
        await asyncio.sleep(0.05)  # the engine takes a request once its current step ends
        timeline = {"arrived_at": time.monotonic(), "scheduled_s": 0.0, "first_token_s": 0.01}
        last = CompletionDelta(0, [8], "b", finish_reason=FinishReason.LENGTH)
        yield RequestOutput("e2", [1, 2, 3], [last], 0, True, timeline=timeline)

    ring = TimelineRing("replica-a")
    asyncio.run(drain(ring, engine_request("e2"), taken_after_the_step_in_progress()))
    (entry,) = ring.lookup("e2")
    timeline = entry["timeline"]
    assert 0.05 <= timeline["engine_arrival_s"] <= timeline["finished_s"]
    assert "arrived_at" not in timeline  # a reading of one process's clock means nothing outside


def test_a_reader_that_leaves_is_recorded_unfinished_and_closes_the_engine_stream():
    closed = []

    async def endless():
        try:
            while True:
                yield RequestOutput("e2", [1], [CompletionDelta(0, [7], "a")], 0, False)
        finally:
            closed.append(True)

    ring = TimelineRing("replica-a")
    asyncio.run(drain(ring, engine_request("e2"), endless(), leave_after=3))
    (entry,) = ring.lookup("e2")
    assert not entry["finished"] and entry["num_output_tokens"] == 3
    assert entry["timeline"]["first_token_s"] is None
    assert closed == [True]


def test_ring_keeps_its_capacity():
    ring = TimelineRing("replica-a", capacity=4)
    for i in range(10):
        ring.add({"request_id": f"c{i}", "engine_request_id": f"e{i}", "received_at": i})
    assert [e["request_id"] for e in ring.entries] == ["c6", "c7", "c8", "c9"]
    assert len(ring.take_new()) == 4


def test_index_finds_a_request_on_any_replica_and_stays_bounded():
    index = TimelineIndex(capacity=2, max_replicas=2)

    def entry(client: str, engine: str, at: float) -> dict:
        return {"request_id": client, "engine_request_id": engine, "received_at": at}

    # A request with two prompts ran on two replicas: both engine requests, oldest first.
    index.add("a", [entry("req", "e-2", 2.0)])
    index.add("b", [entry("req", "e-1", 1.0)])
    assert [e["engine_request_id"] for e in index.lookup("req")] == ["e-1", "e-2"]
    assert index.lookup("e-2") == [entry("req", "e-2", 2.0)]
    index.add("a", [entry("x", "e-3", 3.0), entry("y", "e-4", 4.0)])  # ring of 2: e-2 leaves
    assert [e["engine_request_id"] for e in index.lookup("req")] == ["e-1"]
    index.add("c", [entry("z", "e-5", 5.0)])  # third replica: b, the stalest, leaves
    assert index.lookup("req") == [] and sorted(index.replicas) == ["a", "c"]
