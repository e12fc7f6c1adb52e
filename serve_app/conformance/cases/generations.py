"""The task family (`/v1/generations`, seed 004): a durable resource that can be retrieved,
replayed under its `Idempotency-Key` and cancelled, and its 422 for an output past the
profile's limit. A server whose `/v1/server_info` lists no generation profile has none of
this: every case is `unsupported` there, with the server's own answer.

Profiles sample at their own temperature, so nothing here records generated text: the cases
record what the contract fixes (statuses, codes, headers, the resource's fields, whether two
reads agree), which two runs of one server must repeat exactly."""

from __future__ import annotations

import time
import uuid
from typing import Any

from serve_app.conformance.cases.base import case, json_object, raw_post
from serve_app.conformance.cases.errors import expect_error
from serve_app.conformance.observe import header_facts, shape
from serve_app.conformance.record import CaseRecord
from serve_app.conformance.session import Session

GENERATIONS = "/v1/generations"
TERMINAL = ("completed", "incomplete", "refused", "failed", "cancelled")
# The resource's fields a client relies on (docs/generations.md#the-resource).
RESOURCE_FIELDS = (
    "id", "status", "profile", "artifact", "execution", "output", "finish_reason", "usage",
    "error", "created_at", "finished_at",
)  # fmt: skip
# How long a background generation may take to reach its end once cancelled.
CANCEL_SETTLES_WITHIN_S = 10.0


def text_profile(s: Session, record: CaseRecord) -> dict[str, Any]:
    """A profile this server offers with a text output (the first such), else unsupported."""
    generations = (s.server_info or {}).get("generations") or {}
    profiles = [p for p in generations.get("profiles") or () if isinstance(p, dict)]
    if not profiles:
        r = s.http.get(f"{GENERATIONS}/gen-conformance-probe")
        record.unsupported(
            "no generation profile in /v1/server_info (the task family is not served)",
            {"status": r.status_code, "body": json_object(r)},
        )
    for p in profiles:
        if "text" in (p.get("output_formats") or ["text"]):
            return p
    record.unsupported("no generation profile offers the text output format")


def create_body(profile: dict[str, Any], text: str, execution: str, max_tokens: int) -> dict:
    body: dict[str, Any] = {"profile": profile["name"], "input": text, "execution": execution}
    body["max_output_tokens"] = min(max_tokens, profile.get("max_output_tokens") or max_tokens)
    if profile.get("output_formats"):
        body["output_format"] = "text"
    return body


def create(
    s: Session, record: CaseRecord, body: dict[str, Any], status: int
) -> tuple[dict[str, str], dict[str, Any]]:
    """POST the generation; the case cannot go on unless it is answered `status`."""
    got, headers, created = raw_post(s, record, "create", GENERATIONS, body)
    record.outputs["create"] = {"status": got}
    if got != status or not isinstance(created, dict):
        mode = body["execution"]
        record.fail(f"create ({mode}): HTTP {got}, expected {status}: {created!s:.300}")
    return headers, created


def check_resource(record: CaseRecord, label: str, resource: Any, profile: str) -> None:
    """The fields a generation resource always has, and their meaning once it ended."""
    if not isinstance(resource, dict):
        record.fail(f"{label}: not a JSON object: {str(resource)[:200]}")
    missing = [f for f in RESOURCE_FIELDS if f not in resource]
    record.check(not missing, f"{label}: resource lacks {missing}")
    record.check(
        (resource.get("profile") or {}).get("name") == profile,
        f"{label}: profile {resource.get('profile')!r}, expected {profile!r}",
    )
    if resource.get("status") in TERMINAL and resource.get("status") != "failed":
        usage = resource.get("usage") or {}
        record.check(usage.get("kind") == "final", f"{label}: usage kind {usage.get('kind')!r}")
        record.check(
            isinstance(usage.get("output_tokens"), int), f"{label}: no output_tokens in {usage}"
        )


@case(
    "generations-resource",
    "a sync generation ends terminal with its resource's fields; GET reads the same resource; "
    "an unknown id is 404 generation_not_found",
)
def resource(s: Session, record: CaseRecord) -> None:
    profile = text_profile(s, record)
    body = create_body(profile, "My order arrived damaged.", "sync", 4)
    headers, created = create(s, record, body, 200)
    # The fields, not the sampled output's blocks (an answer cut at its first token has none).
    fields = {k: v for k, v in created.items() if k != "output"}
    record.outputs["shape"] = {"resource": shape(fields)}
    check_resource(record, "create", created, profile["name"])
    record.observation["terminal"] = created.get("status") in TERMINAL
    record.check(created.get("status") in TERMINAL, f"sync: status {created.get('status')!r}")
    location = headers.get("location") or ""
    at_resource = location.endswith(f"/v1/generations/{created.get('id')}")
    record.check(at_resource, f"Location {location!r} is not the resource")
    r = s.http.get(f"{GENERATIONS}/{created.get('id')}")
    record.outputs["retrieve"] = {"status": r.status_code}
    got = json_object(r)
    same = isinstance(got, dict) and all(
        got.get(f) == created.get(f) for f in ("id", "status", "output", "finish_reason", "usage")
    )
    record.observation["retrieved_equal"] = same
    record.check(r.status_code == 200 and same, f"GET: HTTP {r.status_code}, not the same resource")
    r = s.http.get(f"{GENERATIONS}/gen-conformance-missing")
    record.inputs["unknown_id"] = "GET /v1/generations/gen-conformance-missing"
    expect_error(record, "unknown_id", (r.status_code, dict(r.headers), json_object(r)), 404,
                 ("generation_not_found",))  # fmt: skip


@case(
    "generations-idempotency",
    "the same Idempotency-Key and body replays the same resource (Idempotent-Replayed); "
    "another body under it is 409 idempotency_key_reused",
)
def idempotency(s: Session, record: CaseRecord) -> None:
    profile = text_profile(s, record)
    key = {"Idempotency-Key": f"conformance-{uuid.uuid4().hex}"}  # fresh each run: not an input
    body = create_body(profile, "Where is my parcel?", "sync", 4)
    first = raw_post(s, record, "first", GENERATIONS, body, key)
    if first[0] != 200:
        record.fail(f"first: HTTP {first[0]}: {str(first[2])[:300]}")
    again = raw_post(s, record, "repeat", GENERATIONS, body, key)
    record.outputs["repeat"] = {"status": again[0], "headers": header_facts(again[1])}
    replayed = (again[1].get("idempotent-replayed") or "").lower() == "true"
    same = isinstance(again[2], dict) and again[2].get("id") == first[2].get("id")
    record.observation.update(same_resource=same, replayed_header=replayed)
    record.check(again[0] == 200 and same, f"repeat: HTTP {again[0]}, not the same generation")
    record.check(replayed, "repeat: no Idempotent-Replayed: true")
    other = {**body, "input": "Where is my refund?"}
    answer = raw_post(s, record, "other_body", GENERATIONS, other, key)
    expect_error(record, "other_body", answer, 409, ("idempotency_key_reused",))


@case(
    "generations-cancel",
    "a background generation is 202 with Location; cancel ends it (completion may win) and "
    "repeating the cancel changes nothing; the usage it consumed is reported",
)
def cancel(s: Session, record: CaseRecord) -> None:
    profile = text_profile(s, record)
    body = create_body(profile, "Write a long, detailed answer.", "background", 400)
    headers, created = create(s, record, body, 202)
    record.check(bool(headers.get("location")), "background: no Location header")
    gid = created.get("id")
    cancel_path = f"{GENERATIONS}/{gid}/cancel"
    first = s.http.post(cancel_path)
    record.outputs["cancel"] = {"status": first.status_code}
    if first.status_code != 200:
        record.fail(f"cancel: HTTP {first.status_code}: {first.text[:300]}")
    started = time.monotonic()
    ended = json_object(first)
    settle_by = started + CANCEL_SETTLES_WITHIN_S
    while ended.get("status") not in TERMINAL and time.monotonic() < settle_by:
        time.sleep(0.05)
        ended = json_object(s.http.get(f"{GENERATIONS}/{gid}"))
    record.timings["ended_after_cancel_s"] = round(time.monotonic() - started, 3)
    # Completion may win the race, but a 400-token answer rarely does: either is the contract.
    record.observation["ended"] = ended.get("status") in ("cancelled", "completed", "incomplete")
    record.check(record.observation["ended"], f"after cancel: status {ended.get('status')!r}")
    record.notes["status_after_cancel"] = ended.get("status")
    check_resource(record, "after_cancel", ended, profile["name"])
    again = s.http.post(cancel_path)
    repeat = json_object(again)
    unchanged = again.status_code == 200 and all(
        repeat.get(f) == ended.get(f) for f in ("status", "finish_reason", "usage")
    )
    record.outputs["cancel_again"] = {"status": again.status_code}
    record.observation["repeat_unchanged"] = unchanged
    record.check(unchanged, f"a second cancel changed the resource: {str(repeat)[:300]}")


@case(
    "error-generation-limit",
    "max_output_tokens over the profile's limit is 422 max_tokens_exceeded (/v1/generations)",
)
def generation_limit(s: Session, record: CaseRecord) -> None:
    profile = text_profile(s, record)
    limit = profile.get("max_output_tokens")
    if not isinstance(limit, int):
        record.unsupported("the profile states no max_output_tokens")
    body = {**create_body(profile, "hi", "sync", 1), "max_output_tokens": limit + 1}
    answer = raw_post(s, record, "request", GENERATIONS, body)
    expect_error(record, "error", answer, 422, ("max_tokens_exceeded",))
