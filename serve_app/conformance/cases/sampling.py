"""Stops, length, usage, the prefix cache's count, logprobs, seeds."""

from __future__ import annotations

import math
from typing import Any

from serve_app.conformance.cases.base import (
    REFERENCE_PROMPT,
    REFERENCE_TOKENS,
    case,
    chat_body,
    completion_body,
    raw_stream,
    reference_completion,
    returns_token_ids,
    sdk_create,
    with_token_ids,
)
from serve_app.conformance.observe import chat_generation, completion_generation, stream_generations
from serve_app.conformance.record import CaseRecord
from serve_app.conformance.session import Session

STOP_AT = 8  # the reference token a stop cuts at


def _offsets(tokens: list[str]) -> list[int]:
    out, at = [], 0
    for token in tokens:
        out.append(at)
        at += len(token)
    return out


def _stop_from_reference(s: Session, record: CaseRecord, across: bool) -> tuple[str, int]:
    """A stop string first found at a known offset of the greedy reference text: a whole token
    (`across=False`), or the end of one token and the start of the next (`across=True`)."""
    ref = reference_completion(s, record)
    tokens = ref["tokens"]
    if not tokens or "".join(tokens) != ref["text"]:
        record.unsupported("the reference completion's logprob tokens do not spell its text")
    offsets = _offsets(tokens)
    text = ref["text"]
    for k in range(STOP_AT, len(tokens) - 1):
        left, right = tokens[k], tokens[k + 1]
        if across:
            if len(left) < 2 or len(right) < 2:
                continue
            stop, at = left[-2:] + right[:2], offsets[k] + len(left) - 2
        else:
            if len(left.strip()) < 2:
                continue
            stop, at = left, offsets[k]
        if text.find(stop) == at:
            return stop, at
    record.unsupported("the reference text has no stop string at a unique place")


def _stop_case(s: Session, record: CaseRecord, across: bool, include: bool) -> None:
    stop, at = _stop_from_reference(s, record, across)
    text = reference_completion(s, record)["text"]
    fields: dict[str, Any] = {"max_tokens": REFERENCE_TOKENS, "temperature": 0, "stop": [stop]}
    if include:
        fields["include_stop_str_in_output"] = True
    body = completion_body(s, REFERENCE_PROMPT, **fields)
    whole = sdk_create(s, record, "non_streamed", body)
    stream = raw_stream(s, record, "streamed", "/v1/completions", body)
    expected = text[: at + len(stop)] if include else text[:at]
    gen = completion_generation(whole["choices"][0], greedy=True)
    streamed = stream_generations(stream, greedy=True, chat=False)
    record.outputs.update(
        generation=gen, streamed={"generation": streamed[0] if streamed else None}
    )
    record.observation.update(stop=stop, cut_at=at)
    record.check(gen["text"] == expected, f"text {gen['text']!r}, expected {expected!r}")
    record.check(gen["finish_reason"] == "stop", f"finish_reason {gen['finish_reason']!r}")
    if gen.get("stop_reason") is not None:
        record.check(gen["stop_reason"] == stop, f"stop_reason {gen['stop_reason']!r} != {stop!r}")
    if streamed:
        # Text that may start the stop string is held back until decided: never streamed.
        record.check(
            streamed[0]["text"] == expected,
            f"streamed text {streamed[0]['text']!r}, expected {expected!r}",
        )
        record.check(streamed[0]["finish_reason"] == "stop", "streamed finish_reason is not stop")


@case("stop-string-excluded", "a stop string ends the text before it (finish_reason stop)")
def stop_excluded(s: Session, record: CaseRecord) -> None:
    _stop_case(s, record, across=False, include=False)


@case(
    "stop-string-included",
    "include_stop_str_in_output keeps the stop string at the end of the text",
)
def stop_included(s: Session, record: CaseRecord) -> None:
    _stop_case(s, record, across=False, include=True)


@case(
    "stop-string-across-tokens",
    "a stop string spanning two tokens is matched and never streamed in part",
)
def stop_across(s: Session, record: CaseRecord) -> None:
    _stop_case(s, record, across=True, include=False)


@case("stop-token-ids", "stop_token_ids end the output at that token (finish_reason stop)")
def stop_token_ids(s: Session, record: CaseRecord) -> None:
    ref = reference_completion(s, record)
    ids = ref["token_ids"]
    if not returns_token_ids(s) or not ids:
        record.unsupported("the server returns no token ids (return_token_ids)")
    k = next((k for k in range(STOP_AT, len(ids)) if ids[k] not in ids[:k]), None)
    if k is None:
        record.unsupported("no reference token that appears once")
    body = completion_body(s, REFERENCE_PROMPT, max_tokens=REFERENCE_TOKENS, temperature=0)
    whole = sdk_create(
        s, record, "request", with_token_ids(s, {**body, "stop_token_ids": [ids[k]]})
    )
    gen = completion_generation(whole["choices"][0], greedy=True)
    record.outputs["generation"] = gen
    record.observation["stop_token_id"] = ids[k]
    got = gen["token_ids"] or []
    record.check(got[:k] == ids[:k], f"token ids {got} do not start with {ids[:k]}")
    record.check(len(got) in (k, k + 1), f"{len(got)} tokens, expected {k} (+ the stop token)")
    record.check(gen["finish_reason"] == "stop", f"finish_reason {gen['finish_reason']!r}")
    if gen.get("stop_reason") is not None:
        record.check(gen["stop_reason"] == ids[k], f"stop_reason {gen['stop_reason']!r}")


@case("max-tokens-length", "max_tokens truncation is finish_reason length with that many tokens")
def max_tokens_length(s: Session, record: CaseRecord) -> None:
    limit = 5
    body = with_token_ids(s, chat_body(s, "Count to twenty.", max_tokens=limit, temperature=0))
    whole = sdk_create(s, record, "non_streamed", body)
    stream = raw_stream(s, record, "streamed", "/v1/chat/completions", body)
    gen = chat_generation(whole["choices"][0], greedy=True)
    streamed = stream_generations(stream, greedy=True, chat=True)
    usage = whole.get("usage") or {}
    record.outputs.update(generation=gen, usage=usage)
    n = usage.get("completion_tokens")
    if gen["finish_reason"] == "length":
        record.check(n == limit, f"finish_reason length after {n} tokens, max_tokens {limit}")
    else:
        record.check(
            gen["finish_reason"] == "stop" and n is not None and n < limit,
            f"finish_reason {gen['finish_reason']!r} after {n} of {limit} tokens",
        )
    if gen["token_ids"] is not None:
        record.check(len(gen["token_ids"]) == n, f"{len(gen['token_ids'])} ids, usage says {n}")
    if streamed:
        record.check(
            streamed[0]["finish_reason"] == gen["finish_reason"], "streamed finish_reason differs"
        )
    record.observation["finish_reason"] = gen["finish_reason"]


@case("usage-arithmetic", "usage: total = prompt + completion, counts match the token ids (n=2)")
def usage_arithmetic(s: Session, record: CaseRecord) -> None:
    body = completion_body(s, "A list of fruit:", max_tokens=6, temperature=1.0, seed=5, n=2)
    whole = sdk_create(s, record, "request", with_token_ids(s, body))
    usage = whole.get("usage") or {}
    gens = [completion_generation(c, greedy=False) for c in whole["choices"]]
    record.outputs.update(usage=usage, generations=gens)
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    record.check(
        usage.get("total_tokens") == (prompt or 0) + (completion or 0),
        f"total_tokens {usage.get('total_tokens')} != {prompt} + {completion}",
    )
    if all(g["token_ids"] is not None for g in gens):
        produced = sum(len(g["token_ids"]) for g in gens)
        record.check(completion == produced, f"completion_tokens {completion}, ids {produced}")
    prompt_ids = whole["choices"][0].get("prompt_token_ids")
    if prompt_ids is not None:
        record.check(prompt == len(prompt_ids), f"prompt_tokens {prompt}, ids {len(prompt_ids)}")
    record.check(len(gens) == 2, f"{len(gens)} choices for n=2")
    record.check(
        sorted(c.get("index") for c in whole["choices"]) == [0, 1], "choice indexes are not 0, 1"
    )


SHARED_PREFIX = (
    "You are a careful assistant for a harbour office. You answer questions about tides, "
    "berths, cargo manifests, pilot bookings and weather warnings. Keep answers short, name "
    "the document you rely on, and say when you do not know. "
) * 3


@case("cached-tokens-repeated-prefix", "a repeated prompt reports cached_tokens on its repeat")
def cached_tokens(s: Session, record: CaseRecord) -> None:
    body = {
        "model": s.model,
        "messages": [
            {"role": "system", "content": SHARED_PREFIX},
            {"role": "user", "content": "When is high tide?"},
        ],
        "max_tokens": 2,
        "temperature": 0,
    }
    first = sdk_create(s, record, "first", body)
    second = sdk_create(s, record, "repeat", body)
    usage = second.get("usage") or {}
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict) or details.get("cached_tokens") is None:
        record.unsupported("usage.prompt_tokens_details.cached_tokens is not reported", usage)
    cached = details["cached_tokens"]
    first_cached = ((first.get("usage") or {}).get("prompt_tokens_details") or {}).get(
        "cached_tokens"
    )
    record.notes.update(first_cached=first_cached, repeat_cached=cached)
    record.outputs["usage"] = {"prompt_tokens": usage.get("prompt_tokens")}
    record.check(0 < cached <= usage["prompt_tokens"], f"cached_tokens {cached} on the repeat")
    record.check(cached >= (first_cached or 0), "fewer cached tokens on the repeat")
    record.observation["cached_on_repeat"] = cached > 0


def _logprob_checks(record: CaseRecord, entries: list[dict[str, Any]], k: int, label: str):
    for i, entry in enumerate(entries):
        top = entry["top"]
        values = [v for _, v in top]
        record.check(all(v <= 0 for v in values), f"{label} {i}: a logprob above 0")
        record.check(values == sorted(values, reverse=True), f"{label} {i}: top not in order")
        mass = sum(math.exp(v) for v in values)
        record.check(mass <= 1 + 1e-4, f"{label} {i}: top probabilities sum to {mass:.6f} > 1")
        record.check(len(top) >= min(k, 1) and len(top) <= k + 1, f"{label} {i}: {len(top)} top")
        # Greedy: the chosen token is the most likely one.
        if top:
            record.check(
                abs(entry["logprob"] - values[0]) <= 1e-5,
                f"{label} {i}: greedy chose {entry['token']!r} ({entry['logprob']}) "
                f"over {top[0][0]!r} ({values[0]})",
            )


@case("logprobs-chat", "chat logprobs: top-k in order, mass <= 1, the tokens' bytes spell the text")
def logprobs_chat(s: Session, record: CaseRecord) -> None:
    k = 5
    body = chat_body(s, "Say something about ships.", max_tokens=10, temperature=0)
    body = with_token_ids(s, {**body, "logprobs": True, "top_logprobs": k})
    whole = sdk_create(s, record, "request", body)
    gen = chat_generation(whole["choices"][0], greedy=True)
    record.outputs["generation"] = gen
    entries = gen["logprobs"]
    if entries is None:
        record.unsupported("no logprobs in the answer", whole["choices"][0])
    _logprob_checks(record, entries, k, "token")
    spelled = b"".join(bytes(e["bytes"] or b"") for e in entries)
    stated = all(e.get("bytes") is not None for e in entries)
    if stated:
        # The tokens' bytes are the text (an end token the model emitted spells nothing).
        record.check(
            spelled.decode("utf-8", "replace") == gen["text"],
            f"token bytes spell {spelled!r}, text is {gen['text']!r}",
        )
    record.observation["tokenization_stated"] = stated
    if gen["token_ids"] is not None:
        record.check(
            len(gen["token_ids"]) == len(entries),
            f"{len(gen['token_ids'])} token ids, {len(entries)} logprob entries",
        )


@case(
    "logprobs-completions",
    "completions logprobs: tokens join to the text, offsets index it, top-k in order",
)
def logprobs_completions(s: Session, record: CaseRecord) -> None:
    k = 3
    body = completion_body(s, "Ships leave the harbour", max_tokens=10, temperature=0, logprobs=k)
    whole = sdk_create(s, record, "request", with_token_ids(s, body))
    choice = whole["choices"][0]
    gen = completion_generation(choice, greedy=True)
    record.outputs["generation"] = gen
    if gen["logprobs"] is None:
        record.unsupported("no logprobs in the answer", choice)
    _logprob_checks(record, gen["logprobs"], k, "token")
    tokens = choice["logprobs"]["tokens"]
    record.check("".join(tokens) == gen["text"], "the tokens do not join to the text")
    offsets = choice["logprobs"].get("text_offset")
    if offsets is not None:
        record.check(offsets == _offsets(tokens), f"text_offset {offsets}")


@case("seed-repeats", "the same seed at temperature 1 gives the same output twice")
def seed_repeats(s: Session, record: CaseRecord) -> None:
    body = with_token_ids(
        s, completion_body(s, "Sailors sing", max_tokens=12, temperature=1.0, seed=1234)
    )
    first = sdk_create(s, record, "first", body)
    second = sdk_create(s, record, "second", body)
    a = completion_generation(first["choices"][0], greedy=False)
    b = completion_generation(second["choices"][0], greedy=False)
    record.outputs["generation"] = a
    record.check(a["text"] == b["text"], f"{a['text']!r} then {b['text']!r}")
    record.check(a["token_ids"] == b["token_ids"], "token ids differ")
