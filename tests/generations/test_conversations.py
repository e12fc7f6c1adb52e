"""`/v1/conversations` over HTTP: server-managed history, revisions, stale turns, deletion."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.support.generations import poll

pytestmark = pytest.mark.serve

TERMINAL = ("completed", "incomplete", "refused", "failed", "cancelled")
HISTORY = [
    {"role": "user", "content": "Order 17 never arrived."},
    {"role": "assistant", "content": "Sorry to hear that. Let me check."},
]


def new_conversation(url: str, messages: list[dict] | None = None) -> dict:
    r = httpx.post(f"{url}/v1/conversations", json={"messages": messages or []})
    assert r.status_code == 201, r.text
    assert r.headers["location"] == f"/v1/conversations/{r.json()['id']}"
    return r.json()


def turn(url: str, cid: str, revision: int, **extra) -> httpx.Response:
    body = {
        "profile": "support_draft",
        "input": "Any news?",
        "conversation": {"id": cid, "expected_revision": revision},
        **extra,
    }
    return httpx.post(f"{url}/v1/generations", json=body, timeout=120)


def completed_turn(url: str, cid: str, revision: int) -> dict:
    """Turns until one completes (a refused or cut-off turn leaves the history as it was)."""
    for _ in range(20):
        res = turn(url, cid, revision).json()
        assert res["conversation"] == {"id": cid, "expected_revision": revision}
        if res["status"] == "completed":
            return res
        conv = httpx.get(f"{url}/v1/conversations/{cid}").json()
        assert conv["revision"] == revision and conv["pending_generation"] is None
    raise AssertionError("no turn completed in 20 tries")


def test_create_get_delete(serve_url):
    conv = new_conversation(serve_url, HISTORY)
    assert conv["revision"] == 0 and conv["messages"] == HISTORY
    assert conv["expires_at"] == pytest.approx(conv["created_at"] + 24 * 3600, abs=1)
    assert httpx.get(f"{serve_url}/v1/conversations/{conv['id']}").json() == conv
    r = httpx.delete(f"{serve_url}/v1/conversations/{conv['id']}")
    assert r.status_code == 200 and r.json()["deleted"] is True
    for method in ("GET", "DELETE"):
        gone = httpx.request(method, f"{serve_url}/v1/conversations/{conv['id']}")
        assert gone.status_code == 404
        assert gone.json()["error"]["code"] == "conversation_not_found"


def test_a_completed_turn_appends_input_and_reply_and_bumps_the_revision(serve_url):
    conv = new_conversation(serve_url, HISTORY)
    res = completed_turn(serve_url, conv["id"], 0)
    after = httpx.get(f"{serve_url}/v1/conversations/{conv['id']}").json()
    assert after["revision"] == 1 and after["pending_generation"] is None
    reply = after["messages"][-1]
    assert after["messages"][:-1] == [*HISTORY, {"role": "user", "content": "Any news?"}]
    assert reply["role"] == "assistant"
    assert json.loads(reply["content"]) == res["output"][0]["json"]
    # The history is part of the model input: a longer history, another input revision.
    first = turn(serve_url, conv["id"], 1, max_output_tokens=1).json()
    fresh = new_conversation(serve_url, HISTORY)
    other = turn(serve_url, fresh["id"], 0, max_output_tokens=1).json()
    assert first["input_revision"] != other["input_revision"]


def test_a_stale_revision_is_409_and_changes_nothing(serve_url):
    conv = new_conversation(serve_url)
    completed_turn(serve_url, conv["id"], 0)
    stale = turn(serve_url, conv["id"], 0)
    assert stale.status_code == 409
    err = stale.json()["error"]
    assert err["code"] == "stale_revision" and "revision 1" in err["message"]
    assert stale.headers["x-should-retry"] == "false"
    assert httpx.get(f"{serve_url}/v1/conversations/{conv['id']}").json()["revision"] == 1


def test_two_turns_at_once_one_wins_the_other_is_stale(serve_url):
    conv = new_conversation(serve_url)
    long_turn = {"execution": "background", "output_format": "text", "max_output_tokens": 128}
    first = turn(serve_url, conv["id"], 0, **long_turn)
    assert first.status_code == 202
    second = turn(serve_url, conv["id"], 0)
    answered_at = time.time()
    final = poll(serve_url, first.json()["id"], TERMINAL)
    if final["finished_at"] > answered_at:
        # The first turn held the conversation the whole time: the second one was stale.
        assert second.status_code == 409
        assert "another turn is in progress" in second.json()["error"]["message"]
    after = httpx.get(f"{serve_url}/v1/conversations/{conv['id']}").json()
    completed = [r for r in (final, second.json()) if r.get("status") == "completed"]
    assert after["revision"] == len(completed) and after["pending_generation"] is None


def test_unknown_fields_and_roles_are_refused(serve_url):
    r = httpx.post(f"{serve_url}/v1/conversations", json={"messages": [], "title": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "title"
    r = httpx.post(
        f"{serve_url}/v1/conversations", json={"messages": [{"role": "system", "content": "x"}]}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role"
