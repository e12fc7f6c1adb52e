"""The conversation functions every family shares (serve_app/resources/conversations.py):
history as chat messages, appends under the revision rule, the API's errors."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from serve_app import errors
from serve_app.resources.conversations import append_messages, read_history
from serve_app.store.base import ConversationRecord, ConversationTurn, GenerationRecord
from serve_app.store.sqlite import SQLiteStore

QA = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


@pytest.fixture
def store(tmp_path: Path) -> SQLiteStore:
    store = SQLiteStore(tmp_path / "store.sqlite3")
    now = time.time()
    store.create_conversation(ConversationRecord("c1", "t1", 0, [], now, now, now + 99))
    return store


def append(store: SQLiteStore, tenant: str, expected: int | None) -> ConversationRecord:
    return asyncio.run(
        append_messages(store, tenant, "c1", QA, expected_revision=expected, retention_s=600)
    )


def test_appended_messages_read_back_as_the_same_chat_messages(store: SQLiteStore) -> None:
    record = append(store, "t1", expected=0)
    assert record.revision == 1 and record.expires_at > time.time() + 500
    history = asyncio.run(read_history(store, "t1", "c1"))
    assert history.messages == QA and history.revision == 1
    append(store, "t1", expected=None)  # no expectation: appends at whatever revision
    assert asyncio.run(read_history(store, "t1", "c1")).messages == QA + QA


def test_a_stale_revision_or_a_held_turn_is_409_and_another_tenant_404(
    store: SQLiteStore,
) -> None:
    append(store, "t1", expected=0)
    with pytest.raises(errors.APIError) as exc:
        append(store, "t1", expected=0)
    assert (exc.value.status, exc.value.code) == (409, "stale_revision")
    assert "revision 1" in exc.value.message
    now = time.time()
    store.insert_generation(
        GenerationRecord("gen_1", "t1", "queued", "me", {}, now, now),
        turn=ConversationTurn("c1", 1),
    )
    with pytest.raises(errors.APIError) as exc:
        append(store, "t1", expected=None)
    assert exc.value.code == "stale_revision" and "another turn" in exc.value.message
    with pytest.raises(errors.APIError) as exc:
        append(store, "t2", None)
    assert (exc.value.status, exc.value.code) == (404, "conversation_not_found")
    with pytest.raises(errors.APIError) as exc:
        asyncio.run(read_history(store, "t2", "c1", "conversation.id"))
    assert (exc.value.status, exc.value.param) == (404, "conversation.id")
    assert asyncio.run(read_history(store, "t1", "c1")).revision == 1
