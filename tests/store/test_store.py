"""The Store contract, run against every backend (`store` is parametrised by backend name).

A backend joins by adding its name to BACKENDS and a branch to `open_backend`: the factory
must return a fresh Store on the *same* storage each time it is called (that is how a
restart is simulated), with the given clock.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from serve_app.store.base import (
    ConversationRecord,
    ConversationTurn,
    EditOutcome,
    GenerationRecord,
    IdempotencyKey,
    InsertOutcome,
    ResponseRecord,
    Store,
    TurnAppend,
)
from serve_app.store.items import as_chat_messages, message_item
from serve_app.store.sqlite import SQLiteStore
from tests.support.clock import ManualClock

BACKENDS = ["sqlite", "postgresql"]


Opener = Callable[[], Store]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_000_000.0)


@pytest.fixture(params=BACKENDS)
def open_backend(
    request: pytest.FixtureRequest, tmp_path: Path, clock: ManualClock
) -> Iterator[Opener]:
    """A factory of Stores on one backing storage, all on `clock`; closes what it opened."""
    opened: list[Store] = []
    # A fresh database on the session's PostgreSQL server (`postgres_url`, tests/store/conftest.py).
    pg_url = request.getfixturevalue("postgres_url") if request.param == "postgresql" else ""

    def open_one() -> Store:
        if request.param == "sqlite":
            store: Store = SQLiteStore(tmp_path / "store.sqlite3", clock)
        elif request.param == "postgresql":
            from serve_app.store.postgres import PostgresStore

            store = PostgresStore(pg_url, clock)
        else:  # pragma: no cover - each backend adds its branch
            raise AssertionError(request.param)
        opened.append(store)
        return store

    yield open_one
    for store in opened:
        store.close()


@pytest.fixture
def store(open_backend: Opener) -> Store:
    return open_backend()


def gen(gid: str = "gen_1", tenant: str = "t1", status: str = "queued", **data) -> GenerationRecord:
    return GenerationRecord(
        gid, tenant, status, owner="proc-a", data=dict(data), created_at=1.0, updated_at=1.0
    )


def conv(cid: str = "conv_1", tenant: str = "t1", expires_at: float = 2e6) -> ConversationRecord:
    return ConversationRecord(cid, tenant, 0, [], 1.0, 1.0, expires_at)


def key(k: str = "k1", body_hash: str = "h1") -> IdempotencyKey:
    return IdempotencyKey("generations.create", k, body_hash, expires_at=2e6)


# -------------------------------------------------------------------- generations


def test_insert_and_get_is_tenant_scoped(store: Store) -> None:
    result = store.insert_generation(gen(profile="p", output=[{"type": "text", "text": "é"}]))
    assert result.outcome is InsertOutcome.CREATED
    got = store.get_generation("t1", "gen_1")
    assert got is not None and got.status == "queued"
    assert got.data == {"profile": "p", "output": [{"type": "text", "text": "é"}]}
    assert store.get_generation("t2", "gen_1") is None
    assert store.get_generation("t1", "gen_2") is None


def test_update_is_compare_and_set_on_status(store: Store) -> None:
    store.insert_generation(gen())
    running = replace(gen(status="running"), updated_at=2.0)
    assert store.update_generation(running, {"queued"})
    done = replace(gen(status="completed", text="x"), expires_at=5e6)
    cancelled = replace(gen(status="cancelled"), expires_at=5e6)
    assert store.update_generation(done, {"queued", "running"})
    # A cancel that arrives after completion loses the race and changes nothing.
    assert not store.update_generation(cancelled, {"queued", "running"})
    got = store.get_generation("t1", "gen_1")
    assert got is not None and got.status == "completed" and got.data == {"text": "x"}
    # Another tenant cannot write it even with the right status.
    other = replace(gen(tenant="t2", status="failed"))
    assert not store.update_generation(other, {"completed"})


def test_completed_resources_survive_a_restart(open_backend: Opener) -> None:
    first = open_backend()
    first.insert_generation(gen())
    first.finish_generation(
        replace(gen(status="completed", text="kept"), expires_at=5e6), {"queued"}
    )
    first.close()
    second = open_backend()
    got = second.get_generation("t1", "gen_1")
    assert got is not None and got.status == "completed" and got.data == {"text": "kept"}


def test_orphans_are_unfinished_generations_of_silent_owners(
    store: Store, clock: ManualClock
) -> None:
    store.heartbeat("proc-a")
    store.insert_generation(gen("gen_1", status="running"))
    store.insert_generation(gen("gen_2", status="queued"))
    store.insert_generation(gen("gen_3", status="completed"))
    assert store.list_orphaned_generations(stale_after_s=30) == []
    clock.now += 31
    orphans = store.list_orphaned_generations(stale_after_s=30)
    assert sorted(o.id for o in orphans) == ["gen_1", "gen_2"]
    store.heartbeat("proc-a")
    assert store.list_orphaned_generations(stale_after_s=30) == []


# -------------------------------------------------------------------- idempotency


def test_idempotency_key_replays_or_conflicts(store: Store) -> None:
    assert store.insert_generation(gen("gen_1"), key()).outcome is InsertOutcome.CREATED
    replay = store.insert_generation(gen("gen_2"), key())
    assert replay.outcome is InsertOutcome.REPLAY and replay.generation.id == "gen_1"
    reused = store.insert_generation(gen("gen_3"), key(body_hash="other"))
    assert reused.outcome is InsertOutcome.KEY_REUSED and reused.generation.id == "gen_1"
    assert store.get_generation("t1", "gen_2") is None
    assert store.get_generation("t1", "gen_3") is None
    # Scoped by tenant and by operation.
    assert (
        store.insert_generation(gen("gen_4", tenant="t2"), key()).outcome is InsertOutcome.CREATED
    )
    other_op = IdempotencyKey("other.op", "k1", "h1", 2e6)
    assert store.insert_generation(gen("gen_5"), other_op).outcome is InsertOutcome.CREATED


def test_idempotency_key_expires(store: Store, clock: ManualClock) -> None:
    store.insert_generation(gen("gen_1"), IdempotencyKey("op", "k", "h", clock.now + 10))
    clock.now += 11
    assert (
        store.insert_generation(
            gen("gen_2"), IdempotencyKey("op", "k", "h", clock.now + 10)
        ).outcome
        is InsertOutcome.CREATED
    )


def test_concurrent_claims_create_exactly_one(open_backend: Opener) -> None:
    stores = [open_backend() for _ in range(4)]
    outcomes: list[InsertOutcome] = []
    lock = threading.Lock()

    def claim(i: int) -> None:
        result = stores[i % 4].insert_generation(gen(f"gen_{i}"), key())
        with lock:
            outcomes.append(result.outcome)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count(InsertOutcome.CREATED) == 1
    assert outcomes.count(InsertOutcome.REPLAY) == 15


# ------------------------------------------------------------------- conversations


def test_conversation_turns_need_the_current_revision(store: Store) -> None:
    store.create_conversation(conv())
    turn = ConversationTurn("conv_1", expected_revision=0)
    assert store.insert_generation(gen("gen_1"), turn=turn).outcome is InsertOutcome.CREATED
    # The turn is held by gen_1: a second writer at the same revision is stale.
    assert store.insert_generation(gen("gen_2"), turn=turn).outcome is InsertOutcome.STALE_REVISION
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    append = TurnAppend(messages, expires_at=3e6)
    assert store.finish_generation(gen("gen_1", status="completed"), {"queued"}, append)
    got = store.get_conversation("t1", "conv_1")
    assert got is not None and got.revision == 1 and as_chat_messages(got.items) == messages
    assert [item["type"] for item in got.items] == ["message", "message"]
    assert len({item["id"] for item in got.items}) == 2
    assert got.expires_at == 3e6
    assert got.pending_generation is None
    assert store.insert_generation(gen("gen_3"), turn=turn).outcome is InsertOutcome.STALE_REVISION
    next_turn = ConversationTurn("conv_1", expected_revision=1)
    assert store.insert_generation(gen("gen_4"), turn=next_turn).outcome is InsertOutcome.CREATED


def test_a_failed_turn_releases_the_conversation_unchanged(store: Store) -> None:
    store.create_conversation(conv())
    turn = ConversationTurn("conv_1", 0)
    store.insert_generation(gen("gen_1"), turn=turn)
    assert store.finish_generation(gen("gen_1", status="failed"), {"queued", "running"})
    got = store.get_conversation("t1", "conv_1")
    assert got is not None and got.revision == 0 and got.items == []
    assert store.insert_generation(gen("gen_2"), turn=turn).outcome is InsertOutcome.CREATED


def test_conversations_are_tenant_scoped(store: Store) -> None:
    store.create_conversation(conv())
    assert store.get_conversation("t2", "conv_1") is None
    assert not store.delete_conversation("t2", "conv_1")
    result = store.insert_generation(gen(tenant="t2"), turn=ConversationTurn("conv_1", 0))
    assert result.outcome is InsertOutcome.CONVERSATION_NOT_FOUND
    assert store.get_generation("t2", "gen_1") is None
    assert store.update_conversation_metadata("t2", "conv_1", {"a": "b"}, 3e6) is None
    edit = store.append_conversation_items("t2", "conv_1", [message_item("user", "x")], None, 3e6)
    assert edit.outcome is EditOutcome.CONVERSATION_NOT_FOUND
    edit = store.delete_conversation_item("t2", "conv_1", "msg_1", None, 3e6)
    assert edit.outcome is EditOutcome.CONVERSATION_NOT_FOUND
    assert store.delete_conversation("t1", "conv_1")
    assert store.get_conversation("t1", "conv_1") is None
    assert not store.delete_conversation("t1", "conv_1")


def test_item_edits_bump_the_revision_under_the_revision_rule(store: Store) -> None:
    store.create_conversation(conv())
    first, second = message_item("user", "q"), message_item("assistant", "a")
    edit = store.append_conversation_items("t1", "conv_1", [first, second], 0, 3e6)
    assert edit.outcome is EditOutcome.APPLIED and edit.conversation is not None
    assert edit.conversation.revision == 1 and edit.conversation.items == [first, second]
    # A stale expected revision writes nothing; none at all appends at whatever revision.
    stale = store.append_conversation_items("t1", "conv_1", [first], 0, 3e6)
    assert stale.outcome is EditOutcome.STALE_REVISION
    assert stale.conversation is not None and stale.conversation.revision == 1
    missing = store.delete_conversation_item("t1", "conv_1", "msg_none", None, 3e6)
    assert missing.outcome is EditOutcome.ITEM_NOT_FOUND
    deleted = store.delete_conversation_item("t1", "conv_1", first["id"], 1, 3e6)
    assert deleted.outcome is EditOutcome.APPLIED
    got = store.get_conversation("t1", "conv_1")
    assert got is not None and got.revision == 2 and got.items == [second]
    assert got.expires_at == 3e6
    # Metadata is no history: the revision stays.
    updated = store.update_conversation_metadata("t1", "conv_1", {"topic": "billing"}, 4e6)
    assert updated is not None and updated.metadata == {"topic": "billing"}
    assert updated.revision == 2 and updated.expires_at == 4e6


def test_nothing_edits_the_items_while_a_turn_is_pending(store: Store) -> None:
    store.create_conversation(conv())
    store.insert_generation(gen("gen_1"), turn=ConversationTurn("conv_1", 0))
    item = message_item("user", "q")
    for edit in (
        store.append_conversation_items("t1", "conv_1", [item], None, 3e6),
        store.append_conversation_items("t1", "conv_1", [item], 0, 3e6),
        store.delete_conversation_item("t1", "conv_1", "msg_x", None, 3e6),
    ):
        assert edit.outcome is EditOutcome.STALE_REVISION
        assert edit.conversation is not None and edit.conversation.pending_generation == "gen_1"
    store.finish_generation(gen("gen_1", status="failed"), {"queued"})
    edit = store.append_conversation_items("t1", "conv_1", [item], 0, 3e6)
    assert edit.outcome is EditOutcome.APPLIED


OLD_CONVERSATIONS = (
    "CREATE TABLE conversations (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, revision"
    " INTEGER NOT NULL, messages TEXT NOT NULL, pending_generation TEXT, created_at REAL"
    " NOT NULL, updated_at REAL NOT NULL, expires_at DOUBLE PRECISION NOT NULL)"
)
OLD_HISTORY = '[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]'


def old_store(backend: str, tmp_path: Path, pg_url: str) -> Callable[[], Store]:
    """A store written before conversations held items: chat messages, no metadata."""
    insert = "INSERT INTO conversations VALUES ('c1', 't1', 3, %s, NULL, 1, 1, 9e12)"
    if backend == "sqlite":
        import sqlite3

        path = tmp_path / "old.sqlite3"
        with sqlite3.connect(path) as db:
            db.execute(OLD_CONVERSATIONS)
            db.execute(insert.replace("%s", "?"), (OLD_HISTORY,))
        return lambda: SQLiteStore(path)
    import psycopg

    from serve_app.store.postgres import PostgresStore

    with psycopg.connect(pg_url) as db:
        db.execute(OLD_CONVERSATIONS)
        db.execute(insert, (OLD_HISTORY,))
    return lambda: PostgresStore(pg_url)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_conversation_of_the_first_schema_reads_as_items(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    pg_url = request.getfixturevalue("postgres_url") if backend == "postgresql" else ""
    open_old = old_store(backend, tmp_path, pg_url)
    store = open_old()
    try:
        got = store.get_conversation("t1", "c1")
        assert got is not None and got.revision == 3 and got.metadata == {}
        assert as_chat_messages(got.items) == [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
        ]
        assert all(item["id"].startswith("msg_") for item in got.items)
    finally:
        store.close()
    again = open_old()  # migrated once: the ids stay
    try:
        assert again.get_conversation("t1", "c1") == got
    finally:
        again.close()


# ---------------------------------------------------------------------- responses


def response(rid: str = "resp_1", tenant: str = "t1", expires_at: float = 2e6) -> ResponseRecord:
    data = {"response": {"output": [{"type": "message"}]}, "context": [{"role": "user"}]}
    return ResponseRecord(rid, tenant, "completed", data, 1.0, expires_at)


def test_responses_are_tenant_scoped_deleted_once_and_survive_a_restart(
    open_backend: Opener,
) -> None:
    first = open_backend()
    first.insert_response(response())
    first.insert_response(response("resp_2"))
    first.close()
    store = open_backend()
    got = store.get_response("t1", "resp_1")
    assert got is not None and got == response()
    # Another tenant reads, and deletes, nothing.
    assert store.get_response("t2", "resp_1") is None
    assert not store.delete_response("t2", "resp_1")
    assert store.delete_response("t1", "resp_1")
    assert not store.delete_response("t1", "resp_1")
    assert store.get_response("t1", "resp_1") is None
    assert store.get_response("t1", "resp_2") is not None


def test_expired_responses_read_as_absent_then_are_purged(store: Store, clock: ManualClock) -> None:
    store.insert_response(response("resp_old", expires_at=clock.now + 5))
    store.insert_response(response("resp_new", expires_at=clock.now + 50))
    clock.now += 6
    assert store.get_response("t1", "resp_old") is None
    assert not store.delete_response("t1", "resp_old")
    assert store.purge_expired() == 1
    assert store.get_response("t1", "resp_new") is not None


def event(seq: int, kind: str = "response.output_text.delta") -> dict:
    return {"type": kind, "delta": f"w{seq} ", "sequence_number": seq}


def running(rid: str = "resp_1", status: str = "in_progress", **data) -> ResponseRecord:
    return ResponseRecord(rid, "t1", status, {"response": {"id": rid}, **data}, 1.0, 2e6)


def test_response_events_are_appended_and_read_after_a_number(open_backend: Opener) -> None:
    first = open_backend()
    first.insert_response(running(status="queued"), [event(0), event(1)])
    assert first.update_response(running(), {"queued"}, [event(2), event(3)])
    assert first.update_response(running(), {"in_progress"})  # a heartbeat: no new events
    done = running(status="completed")
    assert first.update_response(done, {"in_progress"}, [event(4, "response.completed")])
    first.close()
    store = open_backend()  # kept across a restart
    assert store.get_response_events("t1", "resp_1", -1) == [event(i) for i in range(4)] + [
        event(4, "response.completed")
    ]
    assert store.get_response_events("t1", "resp_1", 2) == [
        event(3), event(4, "response.completed")
    ]  # fmt: skip
    assert store.get_response_events("t1", "resp_1", 4) == []
    # Events live apart from the record: it holds none.
    got = store.get_response("t1", "resp_1")
    assert got is not None and got.status == "completed" and "events" not in got.data
    assert store.get_response_events("t2", "resp_1", -1) == []
    assert store.get_response_events("t1", "resp_2", -1) == []


def test_a_write_may_carry_many_events(store: Store) -> None:
    """More events than one SQL statement takes (a record written after a long stall)."""
    store.insert_response(running(), [event(i) for i in range(450)])
    assert store.update_response(running(), {"in_progress"}, [event(i) for i in range(450, 901)])
    assert store.get_response_events("t1", "resp_1", 399) == [event(i) for i in range(400, 901)]


def test_an_update_that_writes_nothing_appends_no_events(store: Store) -> None:
    store.insert_response(running(), [event(0)])
    # Lost compare-and-set: neither the record nor its events change.
    assert not store.update_response(running(status="failed"), {"queued"}, [event(1)])
    # Events numbered by another writer already: the whole update is undone.
    ended = running(status="cancelled", note="x")
    assert not store.update_response(ended, {"in_progress"}, [event(0), event(1)])
    got = store.get_response("t1", "resp_1")
    assert got is not None and got.status == "in_progress" and "note" not in got.data
    assert store.get_response_events("t1", "resp_1", -1) == [event(0)]
    # Another tenant's update of the same id appends nothing.
    other = replace(running(), tenant="t2")
    assert not store.update_response(other, {"in_progress"}, [event(1)])
    assert store.update_response(running(), {"in_progress"}, [event(1)])
    assert store.get_response_events("t1", "resp_1", 0) == [event(1)]


def test_deleting_or_purging_a_response_removes_its_events(
    store: Store, clock: ManualClock
) -> None:
    store.insert_response(running(), [event(0), event(1)])
    store.insert_response(running("resp_2"), [event(0)])
    assert store.delete_response("t1", "resp_1")
    assert store.get_response_events("t1", "resp_1", -1) == []
    # A record of the same id (a key's id used again) starts with no events.
    store.insert_response(running())
    assert store.get_response_events("t1", "resp_1", -1) == []
    store.insert_response(replace(running("resp_old"), expires_at=clock.now + 5), [event(0)])
    clock.now += 6
    assert store.get_response_events("t1", "resp_old", -1) == []  # expired: absent
    assert store.purge_expired() == 1  # the record; its events go with it, uncounted
    store.insert_response(running("resp_old"))
    assert store.get_response_events("t1", "resp_old", -1) == []
    assert store.get_response_events("t1", "resp_2", -1) == [event(0)]


OLD_RESPONSES = (
    "CREATE TABLE responses (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, status TEXT NOT NULL,"
    " data TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL,"
    " expires_at DOUBLE PRECISION NOT NULL)"
)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_response_of_the_previous_schema_resumes_from_its_record(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A database written before the events table: it gains the table on open, and a record
    that kept its events in `data` still reads them, then those appended after them."""
    legacy = json.dumps({"response": {"id": "r1"}, "events": [event(0), event(1), event(2)]})
    insert = "INSERT INTO responses VALUES ('r1', 't1', 'in_progress', %s, 1, 9e12)"
    if backend == "sqlite":
        import sqlite3

        path = tmp_path / "old.sqlite3"
        with sqlite3.connect(path) as db:
            db.execute(OLD_RESPONSES)
            db.execute(insert.replace("%s", "?"), (legacy,))
        store: Store = SQLiteStore(path)
    else:
        import psycopg

        from serve_app.store.postgres import PostgresStore

        pg_url = request.getfixturevalue("postgres_url")
        with psycopg.connect(pg_url) as db:
            db.execute(OLD_RESPONSES)
            db.execute(insert, (legacy,))
        store = PostgresStore(pg_url)
    try:
        assert store.get_response_events("t1", "r1", 0) == [event(1), event(2)]
        record = store.get_response("t1", "r1")
        assert record is not None
        failed = replace(record, status="failed")
        assert store.update_response(failed, {"in_progress"}, [event(3, "response.failed")])
        assert store.get_response_events("t1", "r1", 1) == [
            event(2), event(3, "response.failed")
        ]  # fmt: skip
        assert store.get_response_events("t1", "r1", 2) == [event(3, "response.failed")]
    finally:
        store.close()


# -------------------------------------------------------------------------- expiry


def test_expired_rows_read_as_absent_then_are_purged(store: Store, clock: ManualClock) -> None:
    store.insert_generation(replace(gen("gen_old", status="completed"), expires_at=clock.now + 5))
    store.insert_generation(gen("gen_live", status="running"))  # unfinished: never expires
    store.create_conversation(conv("conv_old", expires_at=clock.now + 5))
    store.insert_generation(gen("gen_k"), IdempotencyKey("op", "k", "h", clock.now + 5))
    clock.now += 6
    assert store.get_generation("t1", "gen_old") is None
    assert store.get_conversation("t1", "conv_old") is None
    assert store.purge_expired() == 3  # generation, conversation, key
    assert store.get_generation("t1", "gen_live") is not None
    assert store.purge_expired() == 0


def test_sqlite_files_and_the_folder_made_for_them_are_private(tmp_path: Path) -> None:
    """Records hold prompts and outputs: 0600 files (WAL and shm too) in a 0700 folder."""
    path = tmp_path / "data" / "serve-app.sqlite3"
    store = SQLiteStore(path)
    store.create_conversation(conv())
    files = [path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")]
    try:
        assert all(f.exists() for f in files)
        assert {oct(f.stat().st_mode & 0o777) for f in files} == {"0o600"}
        assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    finally:
        store.close()
    # A file left world-readable by an older version is narrowed when it is opened again.
    path.chmod(0o644)
    SQLiteStore(path).close()
    assert oct(path.stat().st_mode & 0o777) == "0o600"
