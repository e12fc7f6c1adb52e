"""The stored-response runner on a scripted engine and a real SQLite store (no Ray):
background runs recorded in batches, resume from any sequence number (from memory and from
the store), cancel here and from another replica, a lost engine, a lost owner."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from actors.messages import EngineRequest
from actors.outputs import CompletionDelta, RequestOutput
from actors.request import FinishReason
from actors.sampling_params import SamplingParams
from serve_app import errors
from serve_app.parsers.chat_output import ParseOptions
from serve_app.responses.admission import AdmittedResponse
from serve_app.responses.protocol import parse_body
from serve_app.responses.runner import FLUSH_EVENTS, ResponseRunner
from serve_app.store.base import ConversationRecord, ResponseRecord
from serve_app.store.sqlite import SQLiteStore

PROMPT = [1, 2, 3, 4]


class FakeStream:
    """What `engine.generate.remote(...)` returns: async outputs, `cancel()` like Serve's."""

    def __init__(self, texts: list[str], delay_s: float, fail_after: int | None) -> None:
        self.texts = list(texts)
        self.delay_s = delay_s
        self.fail_after = fail_after
        self.num_sent = 0
        self.is_cancelled = False

    def cancel(self) -> None:
        self.is_cancelled = True

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> RequestOutput:
        await asyncio.sleep(self.delay_s)
        if self.is_cancelled:
            raise asyncio.CancelledError  # as Serve's generator does once cancelled
        if self.fail_after is not None and self.num_sent >= self.fail_after:
            raise RuntimeError("actor died")  # what a lost engine replica looks like
        if not self.texts:
            raise StopAsyncIteration
        text = self.texts.pop(0)
        self.num_sent += 1
        finish = FinishReason.STOP if not self.texts else None
        delta = CompletionDelta(0, [7], text, finish_reason=finish)
        return RequestOutput("r", PROMPT, [delta], 2, finish is not None)


class FakeEngine:
    def __init__(self, texts: list[str], delay_s: float = 0.0, fail_after: int | None = None):
        self.texts, self.delay_s, self.fail_after = texts, delay_s, fail_after
        self.streams: list[FakeStream] = []
        self.generate = self

    def remote(self, request: Any) -> FakeStream:
        stream = FakeStream(self.texts, self.delay_s, self.fail_after)
        self.streams.append(stream)
        return stream


async def first_output(gen: Any, read: Any = None) -> RequestOutput:
    out = await (read if read is not None else gen.__anext__())
    if out.error is not None:
        raise errors.invalid_grammar(out.error, "text.format")
    return out


def base_of(adm: AdmittedResponse):
    def base(status: str, output: list, usage: Any, **kwargs: Any) -> dict:
        error = kwargs.get("error")
        return {"id": adm.response_id, "status": status, "output": list(output),
                "usage": usage, "error": error}  # fmt: skip

    return base


def admitted(rid: str = "resp_1", background: bool = True, tenant: str = "t") -> AdmittedResponse:
    req = parse_body(f'{{"model": "m", "input": "hi", "background": {str(background).lower()}}}'
                     .encode())  # fmt: skip
    return AdmittedResponse(
        req=req,
        chat=None,  # type: ignore[arg-type]  # the runner never reads it
        tenant=tenant,
        response_id=rid,
        created_at=time.time(),
        engine_request=EngineRequest(rid, PROMPT, SamplingParams(max_tokens=300)),
        parse=ParseOptions(),
    )


class RecordingStore(SQLiteStore):
    """Records what each record write carried: its data's bytes and the events it appended."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.writes: list[tuple[int, list[dict]]] = []

    def insert_response(self, record: ResponseRecord, events: Any = ()) -> None:
        self.writes.append((len(json.dumps(record.data)), list(events)))
        super().insert_response(record, events)

    def update_response(self, record: ResponseRecord, expected: Any, events: Any = ()) -> bool:
        self.writes.append((len(json.dumps(record.data)), list(events)))
        return super().update_response(record, expected, events)


@pytest.fixture
def store(tmp_path: Path):
    s = RecordingStore(tmp_path / "r.sqlite3")
    yield s
    s.close()


def stored_events(store: SQLiteStore, rid: str = "resp_1") -> list[dict]:
    return store.get_response_events("t", rid, -1)


def runner_for(store: SQLiteStore, engine: FakeEngine, orphan_after_s: float = 60.0):
    return ResponseRunner(store, engine, base_of, first_output, 3600.0, orphan_after_s, 3600.0)


async def collect(runner: ResponseRunner, rid: str, after: int = -1, tenant: str = "t"):
    batches = runner.follow_batches(tenant, rid, after)
    return [event async for batch in batches for event in batch]


def check_numbered(events: list[dict]) -> None:
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_a_background_response_is_queued_at_once_and_recorded_in_batches(store):
    texts = [f"w{i} " for i in range(200)]

    async def main():
        runner = runner_for(store, FakeEngine(texts))
        live = await runner.start(admitted())
        # Recorded before start returns; the answer is the queued response.
        assert store.get_response("t", "resp_1") is not None
        assert live.events[1]["response"]["status"] == "queued"
        await asyncio.wait([live.done])
        return live

    live = asyncio.run(main())
    record = store.get_response("t", "resp_1")
    assert record.status == "completed" and record.data["response"]["status"] == "completed"
    events = stored_events(store)
    check_numbered(events)
    assert events == live.events
    assert [e["type"] for e in events[:3]] == [
        "response.created", "response.queued", "response.in_progress"
    ]  # fmt: skip
    assert events[-1]["type"] == "response.completed"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "".join(texts)
    # Batched: one write per FLUSH_EVENTS events at most (plus the first and the last).
    writes = record.data["store_writes"]
    assert writes == live.num_writes == len(store.writes) <= len(events) // FLUSH_EVENTS + 3
    assert record.data["context"][-1]["role"] == "assistant"
    # Each write appends only the events new since the last (the terminal one with the final
    # record): every event is written once, and the record carries none of them.
    appended = [event for _, batch in store.writes for event in batch]
    assert appended == events
    assert all(len(batch) <= FLUSH_EVENTS + 1 for _, batch in store.writes)
    assert "events" not in record.data
    # So a write's bytes stay far below the history's: the record is the response so far.
    history_bytes = len(json.dumps(events))
    assert max(num_bytes for num_bytes, _ in store.writes) < history_bytes / 10


def test_resume_from_any_event_equals_the_uncut_stream(store):
    texts = [f"t{i} " for i in range(40)]

    async def main():
        runner = runner_for(store, FakeEngine(texts, delay_s=0.002))
        await runner.start(admitted())
        # Live, from memory: a reader that joins from the start, and one after event 5.
        whole, tail = await asyncio.gather(collect(runner, "resp_1"), collect(runner, "resp_1", 5))
        assert tail == whole[6:]
        # From the store, after the run (as another replica reads it).
        other = runner_for(store, FakeEngine([]))
        for cut in (-1, 0, 17, len(whole) - 2, len(whole) - 1):
            assert await collect(other, "resp_1", cut) == whole[cut + 1 :]
        assert await collect(other, "resp_1", 0, tenant="u") == []
        return whole

    whole = asyncio.run(main())
    check_numbered(whole)
    assert whole[-1]["type"] == "response.completed"


def test_cancel_while_running_keeps_the_usage_and_is_idempotent(store):
    async def main():
        engine = FakeEngine(["x "] * 1000, delay_s=0.002)
        runner = runner_for(store, engine)
        live = await runner.start(admitted())
        while len(live.events) < 10:
            await asyncio.sleep(0.01)
        first = await runner.cancel("t", "resp_1")
        again = await runner.cancel("t", "resp_1")
        assert await runner.cancel("u", "resp_1") is None  # another tenant: not found
        return engine, first, again, live

    engine, first, again, live = asyncio.run(main())
    assert first["status"] == "cancelled" and again == first
    assert engine.streams[0].is_cancelled
    assert first["usage"]["output_tokens"] > 0 and first["usage"]["input_tokens"] == len(PROMPT)
    record = store.get_response("t", "resp_1")
    assert record.status == "cancelled"
    assert stored_events(store)[-1]["type"] == "response.cancelled"
    check_numbered(stored_events(store))


def test_completion_wins_a_late_cancel(store):
    async def main():
        runner = runner_for(store, FakeEngine(["a", "b"]))
        live = await runner.start(admitted())
        await asyncio.wait([live.done])
        return await runner.cancel("t", "resp_1")

    assert asyncio.run(main())["status"] == "completed"
    assert store.get_response("t", "resp_1").status == "completed"


def test_a_cancel_sent_to_another_replica_stops_the_owner(store):
    async def main():
        engine = FakeEngine(["x "] * 5000, delay_s=0.001)
        owner = runner_for(store, engine)
        live = await owner.start(admitted())
        while live.num_writes < 2:
            await asyncio.sleep(0.01)
        other = runner_for(store, FakeEngine([]))
        return await other.cancel("t", "resp_1"), engine

    final, engine = asyncio.run(main())
    assert final["status"] == "cancelled" and final["usage"]["output_tokens"] > 0
    assert engine.streams[0].is_cancelled


def test_a_lost_engine_fails_the_response_engine_lost_with_its_usage(store):
    async def main():
        runner = runner_for(store, FakeEngine(["a ", "b ", "c "] * 10, fail_after=4))
        live = await runner.start(admitted())
        return await collect(runner, "resp_1"), live

    events, live = asyncio.run(main())
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.failed" and final["error"]["code"] == "engine_lost"
    assert final["usage"]["output_tokens"] == 4
    assert stored_events(store) == events


def test_a_response_whose_owner_is_gone_reads_failed_engine_lost(store):
    async def main():
        engine = FakeEngine(["x "] * 5000, delay_s=0.001)
        owner = runner_for(store, engine)
        await owner.start(admitted())
        await asyncio.sleep(0.05)
        # The owner's process dies (its run stops without a word), its last write grows old.
        engine.streams[0].cancel()
        owner.live.clear()
        while len(owner.tasks):
            await asyncio.sleep(0.01)
        record = store.get_response("t", "resp_1")
        stale = {**record.data, "written_at": time.time() - 120}
        assert store.update_response(replace(record, data=stale), (record.status,))
        other = runner_for(store, FakeEngine([]), orphan_after_s=60)
        return await collect(other, "resp_1", 1)

    events = asyncio.run(main())
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "engine_lost"
    assert store.get_response("t", "resp_1").status == "failed"


def test_a_record_that_kept_its_events_inside_it_still_resumes_and_ends(store):
    """A record the previous revision wrote (its events in `data`), its owner gone."""
    running = {"id": "resp_old", "status": "in_progress", "output": [], "usage": None}
    old = [
        {"type": "response.created", "response": running, "sequence_number": 0},
        {"type": "response.in_progress", "response": running, "sequence_number": 1},
    ]
    data = {"response": running, "input_items": [], "context": [], "events": old,
            "written_at": time.time() - 120}  # fmt: skip
    now = time.time()
    store.insert_response(ResponseRecord("resp_old", "t", "in_progress", data, now, now + 60))

    async def main():
        other = runner_for(store, FakeEngine([]), orphan_after_s=60)
        return await collect(other, "resp_old", 0), await collect(other, "resp_old", -1)

    tail, whole = asyncio.run(main())
    assert whole[:2] == old and tail == whole[1:]
    assert [e["type"] for e in whole] == [
        "response.created", "response.in_progress", "response.failed"
    ]  # fmt: skip
    check_numbered(whole)
    assert whole[-1]["response"]["error"]["code"] == "engine_lost"


def test_a_refused_foreground_response_is_an_error_and_stores_nothing(store):
    class Refusing(FakeEngine):
        def remote(self, request: Any) -> Any:
            stream = super().remote(request)
            stream.texts = []

            async def refuse() -> RequestOutput:
                return RequestOutput("r", PROMPT, [], 0, True, error="bad", error_code="x")

            stream.__anext__ = refuse  # type: ignore[method-assign]
            return stream

    async def main():
        runner = runner_for(store, Refusing([]))
        with pytest.raises(errors.APIError):
            await runner.start(admitted(background=False))

    asyncio.run(main())
    assert store.get_response("t", "resp_1") is None


def test_the_keys_reservation_is_settled_once_to_what_the_response_used(store):
    settled: list[int] = []

    async def main():
        adm = admitted()
        adm.on_end = settled.append
        runner = runner_for(store, FakeEngine(["a ", "b ", "c "]))
        live = await runner.start(adm)
        await asyncio.wait([live.done])
        while len(runner.tasks):
            await asyncio.sleep(0.01)
        return live.done.result()

    final = asyncio.run(main())
    assert settled == [final["usage"]["total_tokens"]] == [len(PROMPT) + 3]


def in_conversation(adm: AdmittedResponse, conversation_id: str) -> AdmittedResponse:
    adm.conversation_id = conversation_id
    adm.input_items = [{"id": "msg_in", "type": "message", "role": "user", "status": "completed",
                        "content": [{"type": "input_text", "text": "hi"}]}]  # fmt: skip
    return adm


def a_conversation(store: SQLiteStore, conversation_id: str = "conv_1") -> ConversationRecord:
    now = time.time()
    record = ConversationRecord(conversation_id, "t", 0, [], now, now, now + 3600)
    store.create_conversation(record)
    return record


def test_a_response_in_a_conversation_appends_its_items_before_it_ends(store):
    a_conversation(store)

    async def main():
        runner = runner_for(store, FakeEngine(["a ", "b "]))
        live = await runner.start(in_conversation(admitted(), "conv_1"))
        await asyncio.wait([live.done])
        # Appended before the terminal event was stored and sent.
        return store.get_conversation("t", "conv_1"), live.done.result()

    conversation, final = asyncio.run(main())
    assert final["status"] == "completed"
    assert conversation.revision == 1  # one revision for the whole turn
    assert [item["id"] for item in conversation.items] == [
        "msg_in", *(item["id"] for item in final["output"])
    ]  # fmt: skip
    assert conversation.items[1:] == final["output"]


def test_a_conversation_deleted_while_it_ran_fails_the_response_with_its_output(store):
    a_conversation(store)

    async def main():
        runner = runner_for(store, FakeEngine(["a ", "b ", "c "], delay_s=0.05))
        live = await runner.start(in_conversation(admitted(), "conv_1"))
        assert store.delete_conversation("t", "conv_1")
        await asyncio.wait([live.done])
        return live.done.result()

    final = asyncio.run(main())
    assert final["status"] == "failed"
    assert final["error"]["code"] == "conversation_not_found"
    assert "not added to the conversation" in final["error"]["message"]
    assert final["output"] and final["usage"]["output_tokens"] == 3
    assert store.get_response("t", "resp_1").status == "failed"


def test_a_cancelled_response_adds_nothing_to_its_conversation(store):
    a_conversation(store)

    async def main():
        runner = runner_for(store, FakeEngine(["a "] * 100, delay_s=0.01))
        await runner.start(in_conversation(admitted(), "conv_1"))
        await asyncio.sleep(0.1)
        return await runner.cancel("t", "resp_1")

    assert asyncio.run(main())["status"] == "cancelled"
    assert store.get_conversation("t", "conv_1").revision == 0
