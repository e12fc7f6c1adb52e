"""The outcome vocabulary on `/v1/generations`, one case per row of the outcome table
(serve_app/outcomes.py), over HTTP against the session server; each row's expected status is
read from `/v1/server_info`'s `outcomes` (the published promise, not a copy of it).

The tiny model's random weights choose between EOS, a JSON value and the refusal branch, so
those rows sample in the background until the row's ending shows (bounded); the others are
constructed: an output limit, a profile whose deadline is shorter than its output takes, a
cancel, a stream reader that stops reading, and a generation whose owner process is gone.
Killing the engine replica mid-generation (the same row, `engine_lost`) is
tests/workers/test_crash_recovery.py's, on a second Serve app."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema
import pytest

from serve_app.store.base import GenerationRecord
from serve_app.store.sqlite import SQLiteStore
from tests.support.generations import (
    ORPHAN_AFTER_S,
    QUICK_DEADLINE_S,
    SESSION,
    SUPPORT_DRAFT_V1,
    poll,
)

pytestmark = pytest.mark.serve

TERMINAL = ("completed", "incomplete", "refused", "failed", "cancelled")
TICKET = "Ticket 5120: the parcel never came, what now?"
MAX_TRIES = 48  # generations a sampled row may take before the test gives up
REPLY = {"profile": "support_reply_v3", "input": TICKET}
DRAFT = {"profile": "support_draft", "input": TICKET}


def start(url: str, body: dict[str, Any]) -> str:
    r = httpx.post(f"{url}/v1/generations", json={**body, "execution": "background"}, timeout=60)
    assert r.status_code == 202, r.text
    return r.json()["id"]


def sample_until(
    url: str, body: dict[str, Any], status: str, with_output: bool = False
) -> dict[str, Any]:
    """Run `body` in the background, four at a time, until one ends with `status` (and, with
    `with_output`, shows some output)."""
    seen: list[tuple[str, str]] = []
    while len(seen) < MAX_TRIES:
        for gid in [start(url, body) for _ in range(4)]:
            final = poll(url, gid, TERMINAL)
            if final["status"] == status and (final["output"] or not with_output):
                return final
            seen.append((final["status"], final["finish_reason"]))
    pytest.fail(f"no '{status}' in {len(seen)} generations: {seen}")


def eos(url: str) -> dict[str, Any]:
    # The random weights can pick EOS as the first token: that generation completes with no
    # text, and an empty text shows no block. Sample until the ending leaves text to check.
    return sample_until(url, {**REPLY, "max_output_tokens": 400}, "completed", with_output=True)


def value(url: str) -> dict[str, Any]:
    return sample_until(url, DRAFT, "completed")


def output_limit(url: str) -> dict[str, Any]:
    # Three sampled tokens can decode to no text yet (part of one UTF-8 character), and an
    # empty text shows no block: sample until the limit leaves some text to show.
    return sample_until(url, {**REPLY, "max_output_tokens": 3}, "incomplete", with_output=True)


def refusal(url: str) -> dict[str, Any]:
    return sample_until(url, DRAFT, "refused")


def deadline(url: str) -> dict[str, Any]:
    return sample_until(url, {"profile": "support_reply_quick", "input": TICKET}, "incomplete")


def cancelled(url: str) -> dict[str, Any]:
    """Cancel right after creating; completion may win the race, so retry (bounded)."""
    for _ in range(MAX_TRIES):
        gid = start(url, {**REPLY, "max_output_tokens": 400})
        final = httpx.post(f"{url}/v1/generations/{gid}/cancel", timeout=60).json()
        if final["status"] == "cancelled":
            return final
    pytest.fail("every cancel lost the race to completion")


def stalled_reader(url: str) -> dict[str, Any]:
    """A stream whose reader takes the first event and then stops reading: the generation
    goes on to its own end (generations detach; they are never aborted as slow)."""
    body = {**REPLY, "max_output_tokens": 400, "execution": "stream"}
    with httpx.stream("POST", f"{url}/v1/generations", json=body, timeout=60) as r:
        created = next(line for line in r.iter_lines() if line.startswith("data: "))
        # Polled while the stream stays open and unread.
        return poll(url, json.loads(created[6:])["id"], TERMINAL)


def owner_lost(url: str) -> dict[str, Any]:
    """A generation left running by a process that is gone (what a server restart finds)."""
    now = time.time()
    gid = f"gen_{uuid.uuid4().hex}"
    data = {"profile": {"name": "support_reply_v3", "version": "3"}, "output": [], "usage": {}}
    store = SQLiteStore(SESSION["data_dir"] / "serve-app.sqlite3")
    try:
        store.insert_generation(GenerationRecord(gid, "default", "running", "gone", data, now, now))
    finally:
        store.close()
    return poll(url, gid, TERMINAL, timeout_s=ORPHAN_AFTER_S * 4)


def check_eos(res: dict[str, Any]) -> None:
    (block,) = res["output"]
    assert block["type"] == "text" and block["text"]
    assert res["usage"]["output_tokens"] < 400  # ended by the model, not by the limit


def check_value(res: dict[str, Any]) -> None:
    (block,) = res["output"]  # validated before `completed`
    assert block["type"] == "json" and block["format"] == "support_draft_v1"
    jsonschema.validate(block["json"], SUPPORT_DRAFT_V1)


def check_limit(res: dict[str, Any]) -> None:
    (block,) = res["output"]  # the text so far
    assert block["type"] == "text" and block["text"]
    assert res["usage"]["output_tokens"] == 3


def check_refusal(res: dict[str, Any]) -> None:
    assert res["output"] == [] and res["error"] is None


def check_deadline(res: dict[str, Any]) -> None:
    # Cut short by the profile's deadline: some output, far from its 900 tokens.
    assert 0 < res["usage"]["output_tokens"] < 900 and res["output"][0]["text"]
    assert res["finished_at"] - res["created_at"] >= QUICK_DEADLINE_S


def check_cancel(res: dict[str, Any]) -> None:
    assert res["usage"]["kind"] == "final" and res["usage"]["output_tokens"] < 400


def check_detached(res: dict[str, Any]) -> None:
    assert (res["status"], res["finish_reason"]) in (
        ("completed", "stop"),
        ("incomplete", "output_limit"),
    )
    assert res["output"][0]["text"] and res["error"] is None


def check_lost(res: dict[str, Any]) -> None:
    assert res["output"] == [] and res["usage"]["output_tokens"] is None  # unknown, not 0


Run = Callable[[str], dict[str, Any]]
Check = Callable[[dict[str, Any]], None]

OUTCOME_CASES: dict[str, tuple[Run, Check]] = {
    # cause: (how to reach it, what else the resource must show)
    "EOS or stop token/string": (eos, check_eos),
    "grammar complete, no continuation but the end": (value, check_value),
    "max tokens": (output_limit, check_limit),
    "refusal branch taken": (refusal, check_refusal),
    "deadline reached while running": (deadline, check_deadline),
    "client cancel / disconnect": (cancelled, check_cancel),
    "slow consumer past its hold deadline": (stalled_reader, check_detached),
    "engine or worker lost, internal error": (owner_lost, check_lost),
}


@pytest.fixture(scope="module")
def promised(serve_url) -> dict[str, dict[str, Any] | None]:
    """The generations column of /v1/server_info's outcome table, by cause."""
    rows = httpx.get(f"{serve_url}/v1/server_info").json()["outcomes"]
    return {row["cause"]: row["generation"] for row in rows}


def test_every_row_of_the_table_has_a_case(promised):
    assert set(OUTCOME_CASES) == set(promised)


@pytest.mark.parametrize("cause", list(OUTCOME_CASES))
def test_each_outcome_row_on_generations(serve_url, promised, cause):
    run, check = OUTCOME_CASES[cause]
    res = run(serve_url)
    row = promised[cause]
    if row is not None:
        assert (res["status"], res["finish_reason"]) == (row["status"], row["finish_reason"])
        assert (res["error"] or {}).get("code") == row.get("error_code"), res["error"]
    else:  # no generation outcome of its own: the generation ends as it would have
        assert res["status"] != "cancelled"
    check(res)
    # Saved as it ended: a later GET reads the same resource.
    assert httpx.get(f"{serve_url}/v1/generations/{res['id']}").json() == res
