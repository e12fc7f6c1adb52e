"""The generation runner on a scripted engine and a real SQLite store (no Ray): outcomes,
cancellation races, detached readers, disconnected waiters and the orphan sweep."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from actors.outputs import CompletionDelta, RequestOutput
from actors.request import FinishReason
from actors.sampling_params import SamplingParams
from serve_app.config.profiles import GenerationOptions
from serve_app.grammar.spec import GrammarSpec
from serve_app.resources.admitted import AdmittedGeneration
from serve_app.resources.resource import resource_json, usage
from serve_app.resources.runner import GenerationRunner
from serve_app.resources.running import Subscriber
from serve_app.store.base import (
    ConversationRecord,
    ConversationTurn,
    GenerationRecord,
    IdempotencyKey,
    InsertOutcome,
)
from serve_app.store.items import as_chat_messages
from serve_app.store.sqlite import SQLiteStore

SCHEMA = {
    "type": "object",
    "properties": {"reply": {"type": "string"}, "refund": {"type": "number"}},
    "required": ["reply", "refund"],
    "additionalProperties": False,
}

Step = tuple[str, str | None]  # (text, finish reason)


class FakeStream:
    """What `engine.generate.remote(...)` returns: async outputs, `cancel()` like Serve's."""

    def __init__(self, steps: list[Step], delay_s: float, error: str | None) -> None:
        self.steps = list(steps)
        self.delay_s = delay_s
        self.error = error
        self.is_cancelled = False

    def cancel(self) -> None:
        self.is_cancelled = True

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> RequestOutput:
        await asyncio.sleep(self.delay_s)
        if self.is_cancelled:
            raise asyncio.CancelledError
        if self.error == "raise" and not self.steps:
            raise RuntimeError("actor died")  # what a lost engine replica looks like
        if self.error is not None and not self.steps:
            return RequestOutput("r", [], [], 0, True, error=self.error, error_code="engine_error")
        if not self.steps:
            raise StopAsyncIteration
        text, finish = self.steps.pop(0)
        reason = FinishReason(finish) if finish else None
        delta = CompletionDelta(0, [7] * max(1, len(text)), text, finish_reason=reason)
        return RequestOutput("r", [], [delta], 3, finish is not None)


class FakeEngine:
    def __init__(self, steps: list[Step], delay_s: float = 0.01, error: str | None = None):
        self.steps, self.delay_s, self.error = steps, delay_s, error
        self.streams: list[FakeStream] = []
        self.generate = self

    def remote(self, request: Any) -> FakeStream:
        stream = FakeStream(self.steps, self.delay_s, self.error)
        self.streams.append(stream)
        return stream


class FakeGrammar:
    def __init__(self) -> None:
        self.compile = self

    def remote(self, spec: GrammarSpec) -> FakeGrammar:
        return self

    async def _to_object_ref(self) -> str:
        return "ref"


@pytest.fixture
def store(tmp_path: Path):
    s = SQLiteStore(tmp_path / "g.sqlite3")
    yield s
    s.close()


def runner_for(store: SQLiteStore, engine: FakeEngine) -> GenerationRunner:
    options = GenerationOptions(orphan_after_s=5)
    return GenerationRunner(store, engine, FakeGrammar(), options, "me", resource_json)


def plan(
    fmt: str = "text", gid: str = "gen_1", turn: ConversationTurn | None = None
) -> AdmittedGeneration:
    now = time.time()
    data = {"output_format": fmt, "usage": usage(4, 0, 0, "estimate"), "output": []}
    record = GenerationRecord(gid, "t1", "queued", "me", data, now, now, None)
    grammar = GrammarSpec("json_schema", "{}") if fmt != "text" else None
    return AdmittedGeneration(
        record,
        [1, 2, 3, 4],
        SamplingParams(max_tokens=8),
        grammar,
        fmt,
        SCHEMA if fmt != "text" else None,
        now + 60,
        turn=turn,
        turn_messages=[{"role": "user", "content": "q"}],
    )


def text(s: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": s}]


async def run_to_end(runner: GenerationRunner, p: AdmittedGeneration) -> GenerationRecord:
    _, live = await runner.submit(p, subscribe=False)
    return await live.done


@pytest.mark.parametrize(
    ("fmt", "steps", "status", "finish", "output"),
    [
        ("text", [("Hel", None), ("lo", "stop")], "completed", "stop", text("Hello")),
        ("text", [("Hel", None), ("lo", "length")], "incomplete", "output_limit", text("Hello")),
        ("text", [("Hel", "timeout")], "incomplete", "timeout", text("Hel")),
        ("draft", [('{"reply":"ok",', None), ('"refund":2}', "stop")], "completed", "stop",
         [{"type": "json", "format": "draft", "json": {"reply": "ok", "refund": 2}}]),
        ("draft", [('{"refusal":"no"}', "stop")], "refused", "refusal", []),
        ("draft", [('{"reply":"o', "length")], "incomplete", "output_limit", []),
        ("draft", [('{"reply":"ok"}', "stop")], "failed", "error", []),
    ],
)  # fmt: skip
def test_outcomes_are_saved_with_final_usage(
    store: SQLiteStore, fmt: str, steps: list[Step], status: str, finish: str, output: list
) -> None:
    runner = runner_for(store, FakeEngine(steps))
    final = asyncio.run(run_to_end(runner, plan(fmt)))
    stored = store.get_generation("t1", "gen_1")
    assert stored is not None and stored == final
    assert (final.status, final.data["finish_reason"], final.data["output"]) == (
        status,
        finish,
        output,
    )
    assert final.data["usage"]["kind"] == "final"
    assert final.data["usage"]["output_tokens"] == sum(max(1, len(t)) for t, _ in steps)
    assert final.expires_at is not None and final.expires_at > time.time()
    if status == "failed":
        assert final.data["error"]["code"] == "invalid_output"


def test_engine_error_fails_with_its_code(store: SQLiteStore) -> None:
    runner = runner_for(store, FakeEngine([], error="worker died"))
    final = asyncio.run(run_to_end(runner, plan()))
    assert final.status == "failed"
    assert final.data["error"] == {"code": "engine_error", "message": "worker died"}


def test_a_lost_engine_replica_fails_the_generation_as_engine_lost(store: SQLiteStore) -> None:
    runner = runner_for(store, FakeEngine([("so far", None)], error="raise"))
    final = asyncio.run(run_to_end(runner, plan()))
    assert (final.status, final.data["finish_reason"]) == ("failed", "error")
    assert final.data["error"]["code"] == "engine_lost"
    assert final.data["usage"]["output_tokens"] == 6 and final.data["usage"]["kind"] == "final"


def test_a_failure_after_output_began_ends_the_stream_with_failed(store: SQLiteStore) -> None:
    runner = runner_for(store, FakeEngine([("par", None), ("tial", None)], error="worker died"))

    async def scenario() -> list[Any]:
        _, live = await runner.submit(plan(), subscribe=True)
        await live.done
        sub = live.subscribers[0]
        return [sub.queue.get_nowait() for _ in range(sub.queue.qsize())]

    events = asyncio.run(scenario())
    assert [e.kind for e in events] == ["delta", "delta", "finished"]
    end = events[-1].data
    assert (end["status"], end["finish_reason"]) == ("failed", "error")
    assert end["error"]["code"] == "engine_error" and end["output"] == []
    assert end["usage"] == {**end["usage"], "output_tokens": 7, "kind": "final"}
    assert store.get_generation("t1", "gen_1").status == "failed"  # saved before the event


def test_cancel_stops_the_engine_and_is_idempotent(store: SQLiteStore) -> None:
    engine = FakeEngine([("x", None)] * 100, delay_s=0.02)
    runner = runner_for(store, engine)

    async def scenario() -> tuple[GenerationRecord, GenerationRecord, GenerationRecord]:
        _, live = await runner.submit(plan(), subscribe=False)
        await asyncio.sleep(0.1)
        first = await runner.cancel("t1", "gen_1")
        again = await runner.cancel("t1", "gen_1")
        return first, again, await live.done

    first, again, final = asyncio.run(scenario())
    assert first.status == again.status == final.status == "cancelled"
    assert final.data["finish_reason"] == "cancelled"
    assert engine.streams[0].is_cancelled
    assert 0 < final.data["usage"]["output_tokens"] < 100
    assert asyncio.run(runner.cancel("t2", "gen_1")) is None  # other tenants: not found


def test_completion_wins_a_late_cancel(store: SQLiteStore) -> None:
    runner = runner_for(store, FakeEngine([("done", "stop")]))
    final = asyncio.run(run_to_end(runner, plan()))
    after = asyncio.run(runner.cancel("t1", "gen_1"))
    assert final.status == after.status == "completed"
    assert after.data["output"] == [{"type": "text", "text": "done"}]


def test_a_cancelled_waiter_does_not_cancel_the_generation(store: SQLiteStore) -> None:
    runner = runner_for(store, FakeEngine([("a", None)] * 10 + [("b", "stop")], delay_s=0.01))

    async def scenario() -> GenerationRecord:
        async def handler() -> None:
            _, live = await runner.submit(plan(), subscribe=True)
            await asyncio.shield(live.done)

        waiter = asyncio.create_task(handler())
        await asyncio.sleep(0.03)
        waiter.cancel()  # what a client disconnect does to the request task
        while runner.live or len(runner.tasks):
            await asyncio.sleep(0.01)
        stored = store.get_generation("t1", "gen_1")
        assert stored is not None
        return stored

    final = asyncio.run(scenario())
    assert final.status == "completed"
    assert final.data["output"] == [{"type": "text", "text": "a" * 10 + "b"}]


def test_a_stalled_reader_is_detached_and_still_gets_the_end(store: SQLiteStore) -> None:
    runner = runner_for(store, FakeEngine([("t", None)] * 30 + [("!", "stop")], delay_s=0.0))

    async def scenario() -> tuple[Subscriber, GenerationRecord]:
        _, live = await runner.submit(plan(), subscribe=False)
        sub = live.subscribe()
        sub.limit = 5
        return sub, await live.done

    sub, final = asyncio.run(scenario())
    assert final.status == "completed" and sub.is_detached
    events = [sub.queue.get_nowait() for _ in range(sub.queue.qsize())]
    assert [e.kind for e in events] == ["delta"] * 5 + ["finished"]
    assert events[-1].data["output"] == [{"type": "text", "text": "t" * 30 + "!"}]


def test_a_completed_turn_is_appended_and_a_failed_one_released(store: SQLiteStore) -> None:
    now = time.time()
    store.create_conversation(ConversationRecord("c1", "t1", 0, [], now, now, now + 99))
    runner = runner_for(store, FakeEngine([("hi", "stop")]))
    asyncio.run(run_to_end(runner, plan(turn=ConversationTurn("c1", 0))))
    conv = store.get_conversation("t1", "c1")
    assert conv is not None and conv.revision == 1 and conv.pending_generation is None
    assert as_chat_messages(conv.items) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "hi"},
    ]
    assert conv.expires_at > now + 99  # retention counts from the last change
    failing = runner_for(store, FakeEngine([], error="lost"))
    asyncio.run(run_to_end(failing, plan(gid="gen_2", turn=ConversationTurn("c1", 1))))
    conv = store.get_conversation("t1", "c1")
    assert conv is not None and conv.revision == 1 and conv.pending_generation is None


def test_orphans_of_a_lost_process_fail_as_engine_lost(store: SQLiteStore) -> None:
    now = time.time()
    store.create_conversation(ConversationRecord("c1", "t1", 0, [], now, now, now + 99))
    orphan = replace(plan().record, owner="crashed-process", status="running")
    store.insert_generation(orphan, turn=ConversationTurn("c1", 0))
    runner = runner_for(store, FakeEngine([]))
    assert runner.sweep_orphans() == 1
    got = store.get_generation("t1", "gen_1")
    assert got is not None and got.status == "failed"
    assert got.data["error"]["code"] == "engine_lost" and got.data["finish_reason"] == "error"
    # What the lost process generated is unknown: said so, not recorded as zero.
    assert got.data["usage"]["output_tokens"] is None and got.data["usage"]["kind"] == "estimate"
    conv = store.get_conversation("t1", "c1")
    assert conv is not None and conv.pending_generation is None and conv.revision == 0
    assert runner.sweep_orphans() == 0


def test_the_budget_is_settled_once_to_measured_usage(store: SQLiteStore) -> None:
    settled: list[int] = []
    runner = runner_for(store, FakeEngine([("ab", None), ("c", "length")]))
    p = plan()
    p.on_end = settled.append
    final = asyncio.run(run_to_end(runner, p))
    assert settled == [4 + final.data["usage"]["output_tokens"]] == [4 + 3]
    # A replay generates nothing: its reservation is settled to zero.
    key = IdempotencyKey("op", "k", "h", time.time() + 60)
    first, again = plan(gid="gen_a"), plan(gid="gen_b")
    first.idempotency = again.idempotency = key
    again.on_end = settled.append
    asyncio.run(run_to_end(runner, first))

    async def replay() -> InsertOutcome:
        result, _ = await runner.submit(again, subscribe=False)
        return result.outcome

    assert asyncio.run(replay()) is InsertOutcome.REPLAY
    assert settled == [7, 0]


def test_a_cancel_through_another_process_stops_the_owner(store: SQLiteStore, tmp_path) -> None:
    engine = FakeEngine([("x", None)] * 200, delay_s=0.02)
    owner = runner_for(store, engine)
    owner.watch_period_s = 0.05
    other_store = SQLiteStore(tmp_path / "g.sqlite3")  # another ingress replica's connection
    other = GenerationRunner(
        other_store, FakeEngine([]), FakeGrammar(), GenerationOptions(), "them", resource_json
    )

    async def scenario() -> tuple[GenerationRecord, GenerationRecord]:
        _, live = await owner.submit(plan(), subscribe=False)
        await asyncio.sleep(0.1)
        answered = await other.cancel("t1", "gen_1")
        return answered, await live.done

    try:
        answered, final = asyncio.run(scenario())
    finally:
        other_store.close()
    assert answered.status == final.status == "cancelled"
    assert answered.data["usage"]["output_tokens"] is None
    assert engine.streams[0].is_cancelled  # the owner stopped its engine work
    assert store.get_generation("t1", "gen_1").status == "cancelled"
