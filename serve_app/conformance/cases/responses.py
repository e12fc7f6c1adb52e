"""The Responses family (`/v1/responses`): the typed event stream in its order with gap-free
`sequence_number`s, the streamed answer equal to the non-streamed one and to what a read of
the stored response returns, and the stored chain (retrieve, `input_items`,
`previous_response_id`, delete, 404 after it). A server without the route has none of this:
every case is `unsupported` there, with the server's own answer.

The cases record what the contract fixes (event kinds in order, statuses, codes, whether two
answers agree), never the sampled text: two runs of one server must repeat exactly."""

from __future__ import annotations

from typing import Any

from serve_app.conformance.cases.base import REFUSED_AS_UNSUPPORTED, case, json_object, raw_post
from serve_app.conformance.cases.errors import expect_error
from serve_app.conformance.observe import shape
from serve_app.conformance.record import CaseRecord
from serve_app.conformance.session import Session, Stream

RESPONSES = "/v1/responses"
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
# The response object's fields a client relies on (docs/responses.md#the-response).
RESPONSE_FIELDS = ("id", "object", "created_at", "status", "output", "usage", "model")
# Item-level events: each names the item (`output_index`) it belongs to.
ITEM_OPEN, ITEM_CLOSE = "response.output_item.added", "response.output_item.done"


def body(s: Session, text: str, **fields: Any) -> dict[str, Any]:
    return {"model": s.model, "input": text, "temperature": 0, **fields}


def create(s: Session, record: CaseRecord, label: str, request: dict[str, Any]) -> dict:
    """POST a non-streamed response; `unsupported` when the server has no such route."""
    status, headers, answer = raw_post(s, record, label, RESPONSES, request)
    record.outputs.setdefault("status", {})[label] = status
    if status in REFUSED_AS_UNSUPPORTED and label == "create" and not _is_response(answer):
        record.unsupported(f"POST {RESPONSES}: HTTP {status}", answer)
    if status != 200 or not _is_response(answer):
        record.fail(f"{label}: HTTP {status}: {str(answer)[:300]}")
    missing = [f for f in RESPONSE_FIELDS if f not in answer]
    record.check(not missing, f"{label}: the response lacks {missing}")
    record.check(answer.get("object") == "response", f"{label}: object {answer.get('object')!r}")
    return answer


def output_text(response: dict[str, Any]) -> str:
    """The text of the response's message items, joined (the SDK's `output_text`)."""
    return "".join(
        part.get("text", "")
        for item in response.get("output") or []
        if item.get("type") == "message"
        for part in item.get("content") or []
        if part.get("type") == "output_text"
    )


def event_kinds(events: list[dict[str, Any]]) -> list[str]:
    """The events' types in order, a run of deltas of one kind counted once (chunking is not
    compared: fragmentation changes chunking, never meaning)."""
    kinds: list[str] = []
    for event in events:
        kind = str(event.get("type"))
        if kind.endswith(".delta") and kinds and kinds[-1] == f"{kind}+":
            continue
        kinds.append(f"{kind}+" if kind.endswith(".delta") else kind)
    return kinds


def order_problems(events: list[dict[str, Any]]) -> list[str]:
    """How the stream breaks the typed event order of docs/responses.md#the-event-stream."""
    problems: list[str] = []
    kinds = [str(e.get("type")) for e in events]
    if kinds[:2] != ["response.created", "response.in_progress"]:
        problems.append(f"starts with {kinds[:2]}, not response.created, response.in_progress")
    terminal = [i for i, k in enumerate(kinds) if k in TERMINAL_EVENTS]
    if len(terminal) != 1 or terminal[0] != len(kinds) - 1:
        problems.append(f"terminal events at {terminal} of {len(kinds)}: one, last, expected")
    numbers = [e.get("sequence_number") for e in events]
    if numbers != list(range(len(events))):
        problems.append(f"sequence_numbers {numbers[:8]}... are not 0, 1, 2, ... without gaps")
    open_item: int | None = None
    for event, kind in zip(events, kinds, strict=True):
        index = event.get("output_index")
        if kind == ITEM_OPEN:
            if open_item is not None:
                problems.append(f"item {index} opens before item {open_item} closes")
            open_item = index
        elif kind == ITEM_CLOSE:
            if index != open_item:
                problems.append(f"item {index} closes while item {open_item} is open")
            open_item = None
        elif index is not None and index != open_item:
            problems.append(f"{kind} for item {index} outside it (open: {open_item})")
    if open_item is not None:
        problems.append(f"item {open_item} never closes")
    return problems


def streamed_text(events: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """The output text the deltas carry, and each `output_text.done` text."""
    deltas = "".join(
        str(e.get("delta", "")) for e in events if e.get("type") == "response.output_text.delta"
    )
    done = [str(e.get("text")) for e in events if e.get("type") == "response.output_text.done"]
    return deltas, done


@case(
    "responses-stream",
    "/v1/responses: typed events in order with gap-free sequence_numbers, nothing after the "
    "terminal event; the deltas, the done text, the terminal response, the non-streamed answer "
    "and the stored response agree",
)
def stream(s: Session, record: CaseRecord) -> None:
    request = body(s, "Describe the sea in one sentence.", max_output_tokens=12)
    whole = create(s, record, "create", request)
    live: Stream = s.stream(RESPONSES, {**request, "stream": True})
    record.inputs["stream"] = {**request, "stream": True}
    record.outputs.setdefault("status", {})["stream"] = live.status
    if live.status != 200:
        record.fail(f"stream: HTTP {live.status}: {str(live.body)[:300]}")
    events = [e for e in live.events if isinstance(e, dict) and "type" in e]
    others = [e for e in live.events if e not in events]
    record.outputs["event_kinds"] = event_kinds(events)
    record.outputs["shape"] = {"terminal": shape(events[-1] if events else {})}
    record.check(not others, f"events that are not typed JSON: {str(others)[:200]}")
    named = live.event_names == [e["type"] for e in events]
    record.observation["event_lines_name_types"] = named
    record.check(named, f"event: lines {live.event_names[:4]}... do not name the data's types")
    record.check(not live.after_done, f"lines after [DONE]: {live.after_done[:3]}")
    problems = order_problems(events)
    record.observation["order_problems"] = problems
    record.check(not problems, f"event order: {problems}")
    if not events or events[-1].get("type") not in TERMINAL_EVENTS:
        record.fail("the stream has no terminal event")
    final = events[-1].get("response") or {}
    deltas, done = streamed_text(events)
    agree = {
        "deltas_equal_done": done == [deltas],
        "deltas_equal_terminal": deltas == output_text(final),
        "stream_equals_nonstream": output_text(final) == output_text(whole)
        and final.get("status") == whole.get("status"),
    }
    if final.get("store", True) and final.get("id"):
        r = s.http.get(f"{RESPONSES}/{final['id']}")
        stored = r.json() if r.status_code == 200 else {}
        record.outputs["status"]["retrieve"] = r.status_code
        agree["stored_equals_terminal"] = all(
            stored.get(f) == final.get(f) for f in ("id", "status", "output", "usage")
        )
    record.observation.update(agree)
    for name, ok in agree.items():
        record.check(ok, f"{name.replace('_', ' ')}: no")


@case(
    "responses-chain",
    "/v1/responses: a stored response reads back, lists its input, continues through "
    "previous_response_id; deleted, it is 404 response_not_found to read and to chain; an "
    "unknown field is 400 unknown_parameter",
)
def chain(s: Session, record: CaseRecord) -> None:
    first = create(s, record, "create", body(s, "My name is Ada.", max_output_tokens=4))
    rid = first["id"]
    r = s.http.get(f"{RESPONSES}/{rid}")
    record.outputs["status"]["retrieve"] = r.status_code
    same = r.status_code == 200 and r.json().get("output") == first.get("output")
    record.observation["retrieved_equal"] = same
    record.check(same, f"GET: HTTP {r.status_code}, not the response created")
    r = s.http.get(f"{RESPONSES}/{rid}/input_items")
    items = r.json().get("data") if r.status_code == 200 else None
    record.outputs["status"]["input_items"] = r.status_code
    listed = isinstance(items, list) and any(
        part.get("text") == "My name is Ada."
        for item in items
        for part in (item.get("content") or [])
        if isinstance(part, dict)
    )
    record.observation["input_listed"] = listed
    record.check(listed, f"input_items: HTTP {r.status_code}, the input message not listed")
    follow = body(s, "What is my name?", max_output_tokens=4, previous_response_id=rid)
    second = create(s, record, "chained", follow)
    alone = create(s, record, "unchained", body(s, "What is my name?", max_output_tokens=4))
    longer = _input_tokens(second) > _input_tokens(alone)
    record.observation["chain_in_context"] = longer
    record.check(longer, "the chained response's input_tokens do not count the previous turn")
    r = s.http.delete(f"{RESPONSES}/{rid}")
    record.outputs["status"]["delete"] = r.status_code
    deleted = r.status_code == 200 and r.json().get("deleted") is True
    record.check(deleted, f"DELETE: HTTP {r.status_code}: {r.text[:200]}")
    r = s.http.get(f"{RESPONSES}/{rid}")
    gone = (r.status_code, dict(r.headers), json_object(r))
    expect_error(record, "after_delete", gone, 404, ("response_not_found",))
    answer = raw_post(s, record, "chain_deleted", RESPONSES, {**follow})
    expect_error(record, "chain_deleted", answer, 404, ("response_not_found",))
    unknown = {**body(s, "hi", max_output_tokens=1), "frobnicate": True}
    answer = raw_post(s, record, "unknown_field", RESPONSES, unknown)
    expect_error(record, "unknown_field", answer, 400, ("unknown_parameter",), param="frobnicate")


def _input_tokens(response: dict[str, Any]) -> int:
    return int((response.get("usage") or {}).get("input_tokens") or 0)


def _is_response(answer: Any) -> bool:
    return isinstance(answer, dict) and answer.get("object") == "response"
