"""Streams: the same answer streamed and not, the event order, UTF-8 across chunks."""

from __future__ import annotations

from typing import Any

from serve_app.conformance.cases.base import (
    case,
    chat_body,
    completion_body,
    raw_stream,
    sdk_create,
    sdk_stream,
    with_token_ids,
)
from serve_app.conformance.observe import (
    chat_generation,
    completion_generation,
    order_violations,
    stream_events,
    stream_generations,
    stream_usage,
)
from serve_app.conformance.record import CaseRecord
from serve_app.conformance.session import Session, Stream

LOGPROB_TOLERANCE = 1e-4  # streamed and non-streamed logprobs of one server


def same_generation(record: CaseRecord, label: str, a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in ("text", "token_ids", "finish_reason", "stop_reason", "tool_calls"):
        if key in a or key in b:
            record.check(
                a.get(key) == b.get(key), f"{label}: {key} {a.get(key)!r} != {b.get(key)!r}"
            )
    la, lb = a.get("logprobs"), b.get("logprobs")
    if la is None or lb is None:
        record.check(la is None and lb is None, f"{label}: logprobs present in only one")
        return
    record.check(
        [e["token"] for e in la] == [e["token"] for e in lb], f"{label}: logprob tokens differ"
    )
    worst = max((abs(x["logprob"] - y["logprob"]) for x, y in zip(la, lb, strict=False)), default=0)
    record.check(worst <= LOGPROB_TOLERANCE, f"{label}: logprobs differ by {worst:.2e}")


COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def same_usage(record: CaseRecord, streamed: dict | None, whole: dict | None) -> None:
    """The token counts agree (the repeat may find the first one's prompt cached)."""
    a = {k: (streamed or {}).get(k) for k in COUNTS}
    b = {k: (whole or {}).get(k) for k in COUNTS}
    record.outputs["usage"] = b
    record.check(a == b, f"streamed usage {a} != non-streamed {b}")


@case("stream-equals-nonstream-chat", "chat: the streamed answer joined equals the non-streamed")
def stream_equals_chat(s: Session, record: CaseRecord) -> None:
    body = chat_body(s, "Describe the sea in one sentence.", max_tokens=16, temperature=0)
    body = with_token_ids(s, {**body, "logprobs": True, "top_logprobs": 2})
    whole = sdk_create(s, record, "non_streamed", body)
    chunks = sdk_stream(s, record, "streamed", {**body, "stream_options": {"include_usage": True}})
    expected = chat_generation(whole["choices"][0], greedy=True)
    got = stream_generations(Stream(200, {}, events=chunks), greedy=True, chat=True)
    record.outputs.update(generation=expected, streamed={"generation": got[0] if got else None})
    record.check(len(got) == 1, f"{len(got)} streamed choices, expected 1")
    if got:
        same_generation(record, "streamed vs non-streamed", got[0], expected)
    same_usage(record, stream_usage(Stream(200, {}, events=chunks)), whole.get("usage"))
    record.observation["equal"] = not record.violations


@case(
    "stream-equals-nonstream-completions",
    "completions: the streamed answer joined equals the non-streamed",
)
def stream_equals_completions(s: Session, record: CaseRecord) -> None:
    body = completion_body(s, "The harbour at dawn", max_tokens=16, temperature=0, logprobs=2)
    body = with_token_ids(s, body)
    whole = sdk_create(s, record, "non_streamed", body)
    stream = raw_stream(
        s,
        record,
        "streamed",
        "/v1/completions",
        {**body, "stream_options": {"include_usage": True}},
    )
    expected = completion_generation(whole["choices"][0], greedy=True)
    got = stream_generations(stream, greedy=True, chat=False)
    record.outputs.update(generation=expected, streamed={"generation": got[0] if got else None})
    record.check(len(got) == 1, f"{len(got)} streamed choices, expected 1")
    if got:
        same_generation(record, "streamed vs non-streamed", got[0], expected)
    same_usage(record, stream_usage(stream), whole.get("usage"))
    record.observation["equal"] = not record.violations


@case(
    "stream-event-order",
    "chat, n=2, usage asked: role → deltas → one finish per choice → usage → [DONE], nothing after",
)
def event_order(s: Session, record: CaseRecord) -> None:
    body = chat_body(
        s,
        "Name three colours.",
        max_tokens=12,
        temperature=1.0,
        seed=11,
        n=2,
        stream_options={"include_usage": True},
    )
    stream = raw_stream(s, record, "streamed", "/v1/chat/completions", body)
    events = stream_events(stream)
    wrong = order_violations(events, chat=True, usage_asked=True)
    for message in wrong:
        record.check(False, message)
    record.check(sorted(events["choices"]) == ["0", "1"], f"choices {sorted(events['choices'])}")
    usage = stream_usage(stream) or {}
    gens = stream_generations(stream, greedy=False, chat=True)
    record.outputs.update(events=events, generations=gens)
    if stream.after_done:
        record.notes["after_done"] = stream.after_done[:5]
    record.observation["order_ok"] = not wrong
    record.observation["usage_total_ok"] = usage.get("total_tokens") == (
        usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
    )


UTF8_CHOICES = ["日本語のテキスト", "🙂🙃 ok", "ελληνικά"]


@case("utf8-split", "UTF-8 split across tokens is never emitted half (a multi-byte choice)")
def utf8_split(s: Session, record: CaseRecord) -> None:
    body = chat_body(s, "Pick one.", max_tokens=40, temperature=0)
    body = with_token_ids(s, {**body, "structured_outputs": {"choice": UTF8_CHOICES}})
    whole = sdk_create(s, record, "non_streamed", body)
    stream = raw_stream(s, record, "streamed", "/v1/chat/completions", body)
    expected = chat_generation(whole["choices"][0], greedy=True)
    got = stream_generations(stream, greedy=True, chat=True)
    deltas = [
        (c.get("delta") or {}).get("content") or ""
        for chunk in stream.chunks
        for c in chunk.get("choices") or []
    ]
    half = [d for d in deltas if "\ufffd" in d]
    record.outputs.update(generation=expected, streamed={"generation": got[0] if got else None})
    record.check(expected["text"] in UTF8_CHOICES, f"{expected['text']!r} is not a choice")
    record.check(not half, f"deltas with a replacement character: {half[:3]}")
    if got:
        same_generation(record, "streamed vs non-streamed", got[0], expected)
    ids = expected.get("token_ids")
    # Whether the output's characters really spanned several tokens (what the case tests).
    record.observation["multi_token_characters"] = (
        None if ids is None else len(ids) > len(expected["text"])
    )
    record.observation["no_half_characters"] = not half
