"""`/v1/conversations` over HTTP: OpenAI's Conversations API through the official client,
our revision rule (generation turns, `expected_revision`, 409 `stale_revision`), deletion."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.support.generations import poll

pytestmark = pytest.mark.serve

TERMINAL = ("completed", "incomplete", "refused", "failed", "cancelled")
HISTORY = [
    {"role": "user", "content": "Order 17 never arrived."},
    {"role": "assistant", "content": "Sorry to hear that. Let me check."},
]


def new_conversation(url: str, messages: list[dict] | None = None) -> dict:
    r = httpx.post(f"{url}/v1/conversations", json={"items": messages or []})
    assert r.status_code == 201, r.text
    assert r.headers["location"] == f"/v1/conversations/{r.json()['id']}"
    return r.json()


def history(url: str, cid: str) -> list[dict]:
    """The conversation's items, oldest first, as `{"role", "content"}` messages."""
    r = httpx.get(f"{url}/v1/conversations/{cid}/items", params={"order": "asc", "limit": 100})
    assert r.status_code == 200, r.text
    return [
        {"role": item["role"], "content": "".join(p["text"] for p in item["content"])}
        for item in r.json()["data"]
    ]


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
    seen = []
    for _ in range(20):
        res = turn(url, cid, revision).json()
        assert res["conversation"] == {"id": cid, "expected_revision": revision}
        if res["status"] == "completed":
            return res
        seen.append((res["status"], res.get("finish_reason"), res.get("error")))
        conv = httpx.get(f"{url}/v1/conversations/{cid}").json()
        assert conv["revision"] == revision and conv["pending_generation"] is None
    raise AssertionError(f"no turn completed in 20 tries: {seen}")


# ------------------------------------------------------------ the official client


def test_the_sdk_creates_retrieves_updates_and_deletes_a_conversation(client):
    conv = client.conversations.create(items=HISTORY, metadata={"ticket": "4411"})
    assert conv.object == "conversation" and conv.id.startswith("conv_")
    assert conv.metadata == {"ticket": "4411"} and isinstance(conv.created_at, int)
    assert conv.model_extra["revision"] == 0
    got = client.conversations.retrieve(conv.id)
    assert got == conv
    updated = client.conversations.update(conv.id, metadata={"ticket": "4411", "tier": "gold"})
    assert updated.metadata == {"ticket": "4411", "tier": "gold"}
    # Metadata is no history: the revision stays.
    assert updated.model_extra["revision"] == 0
    assert client.conversations.retrieve(conv.id).metadata == updated.metadata
    deleted = client.conversations.delete(conv.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (conv.id, "conversation.deleted", True)
    for call in (client.conversations.retrieve, client.conversations.delete):
        with pytest.raises(openai.NotFoundError) as exc:
            call(conv.id)
        assert exc.value.body["code"] == "conversation_not_found"


def test_the_sdk_adds_lists_retrieves_and_deletes_items(client):
    conv = client.conversations.create(items=HISTORY[:1])
    added = client.conversations.items.create(
        conv.id,
        items=[
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": HISTORY[1]["content"]}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Still nothing."}]},
        ],
    )  # fmt: skip
    assert added.object == "list" and [i.role for i in added.data] == ["assistant", "user"]
    assert added.first_id == added.data[0].id and added.has_more is False
    # Newest first by default, as OpenAI lists; `after` pages on.
    listed = list(client.conversations.items.list(conv.id, limit=2))
    assert [i.content[0].text for i in listed] == [
        "Still nothing.", HISTORY[1]["content"], HISTORY[0]["content"],
    ]  # fmt: skip
    assert [i.content[0].type for i in listed] == ["input_text", "output_text", "input_text"]
    page = client.conversations.items.list(conv.id, order="asc", limit=1)
    assert page.has_more is True and page.data[0].role == "user"
    assert page.first_id == page.last_id == page.data[0].id
    item = client.conversations.items.retrieve(listed[1].id, conversation_id=conv.id)
    assert item.type == "message" and item.id == listed[1].id and item.status == "completed"
    after = client.conversations.items.delete(listed[1].id, conversation_id=conv.id)
    assert after.object == "conversation" and after.id == conv.id
    assert after.model_extra["revision"] == 2  # one per change: added, then deleted
    with pytest.raises(openai.NotFoundError) as exc:
        client.conversations.items.retrieve(listed[1].id, conversation_id=conv.id)
    assert exc.value.body["code"] == "item_not_found"
    assert [i.id for i in client.conversations.items.list(conv.id)] == [listed[0].id, listed[2].id]


def test_an_expected_revision_guards_item_edits(client, serve_url):
    conv = client.conversations.create()
    new = [{"role": "user", "content": "hello"}]
    client.conversations.items.create(conv.id, items=new, extra_body={"expected_revision": 0})
    with pytest.raises(openai.ConflictError) as exc:
        client.conversations.items.create(conv.id, items=new, extra_body={"expected_revision": 0})
    assert exc.value.body["code"] == "stale_revision" and "revision 1" in exc.value.message
    assert exc.value.response.headers["x-should-retry"] == "false"
    first = client.conversations.items.list(conv.id).data[0].id
    stale = httpx.delete(
        f"{serve_url}/v1/conversations/{conv.id}/items/{first}", params={"expected_revision": 0}
    )
    assert stale.status_code == 409 and stale.json()["error"]["code"] == "stale_revision"
    assert client.conversations.retrieve(conv.id).model_extra["revision"] == 1


def test_create_get_delete(serve_url):
    conv = new_conversation(serve_url, HISTORY)
    assert conv["revision"] == 0 and history(serve_url, conv["id"]) == HISTORY
    assert conv["expires_at"] == pytest.approx(conv["created_at"] + 24 * 3600, abs=1)
    assert httpx.get(f"{serve_url}/v1/conversations/{conv['id']}").json() == conv
    r = httpx.delete(f"{serve_url}/v1/conversations/{conv['id']}")
    assert r.status_code == 200 and r.json()["deleted"] is True
    for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/items"), ("POST", "")):
        gone = httpx.request(
            method, f"{serve_url}/v1/conversations/{conv['id']}{path}", json={"metadata": None}
        )
        assert gone.status_code == 404
        assert gone.json()["error"]["code"] == "conversation_not_found"


def test_a_completed_turn_appends_input_and_reply_and_bumps_the_revision(serve_url):
    conv = new_conversation(serve_url, HISTORY)
    res = completed_turn(serve_url, conv["id"], 0)
    after = httpx.get(f"{serve_url}/v1/conversations/{conv['id']}").json()
    assert after["revision"] == 1 and after["pending_generation"] is None
    messages = history(serve_url, conv["id"])
    reply = messages[-1]
    assert messages[:-1] == [*HISTORY, {"role": "user", "content": "Any news?"}]
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


def test_item_edits_wait_for_a_pending_turn(serve_url):
    conv = new_conversation(serve_url)
    long_turn = {"execution": "background", "output_format": "text", "max_output_tokens": 128}
    first = turn(serve_url, conv["id"], 0, **long_turn)
    assert first.status_code == 202
    edit = httpx.post(
        f"{serve_url}/v1/conversations/{conv['id']}/items",
        json={"items": [{"role": "user", "content": "x"}]},
    )
    answered_at = time.time()
    final = poll(serve_url, first.json()["id"], TERMINAL)
    if final["finished_at"] > answered_at:
        # The turn held the conversation: the edit was refused and changed nothing.
        assert edit.status_code == 409 and edit.json()["error"]["code"] == "stale_revision"
        assert "another turn is in progress" in edit.json()["error"]["message"]
    completed = final["status"] == "completed"
    after = httpx.get(f"{serve_url}/v1/conversations/{conv['id']}").json()
    assert after["revision"] == int(completed) + int(edit.status_code == 200)


def test_unknown_fields_roles_and_item_types_are_refused(serve_url):
    cases = [
        ({"items": [], "title": "x"}, "unknown_parameter", "title"),
        # The old shape's field: moved to `items` (a 400, never silently dropped).
        ({"messages": [{"role": "user", "content": "x"}]}, "unknown_parameter", "messages"),
        ({"items": [{"role": "system", "content": "x"}]}, "invalid_request", "items.0.role"),
        ({"items": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
         "unsupported_parameter", "items.0.type"),
        ({"items": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "unsupported_parameter", "items.0.content.0.type"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "invalid_request", "metadata"),
    ]  # fmt: skip
    for body, code, param in cases:
        r = httpx.post(f"{serve_url}/v1/conversations", json=body)
        assert r.status_code == 400, (body, r.text)
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == (code, param), body
    cid = new_conversation(serve_url)["id"]
    r = httpx.get(f"{serve_url}/v1/conversations/{cid}/items", params={"order": "sideways"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "order"
    r = httpx.get(f"{serve_url}/v1/conversations/{cid}/items", params={"after": "msg_none"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "after"
    r = httpx.post(f"{serve_url}/v1/conversations/{cid}/items", json={"items": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "items"
