"""Every error class of the taxonomy, with its status, `code` and retry headers. Classes a black
box cannot be made to show are provoked where the suite can (a key limited to one concurrent
request for 429, the admin drain for 503) and are `unsupported` otherwise."""

from __future__ import annotations

import time
from typing import Any

from serve_app.conformance.cases.base import (
    case,
    chat_body,
    completion_body,
    long_output,
    raw_post,
)
from serve_app.conformance.observe import error_facts, is_error_shape
from serve_app.conformance.record import CaseRecord
from serve_app.conformance.session import Session

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# The retry headers each status must carry (docs/contract.md#retry-headers).
SHOULD_RETRY = {429: "true", 503: "true"}


def expect_error(
    record: CaseRecord,
    label: str,
    answer: tuple[int, dict[str, str], Any],
    status: int,
    codes: tuple[str, ...],
    param: str | None = None,
) -> dict[str, Any]:
    """Record an error answer and check it against its class: status, the one error shape,
    `code`, `param` when the request names one, and the retry headers."""
    got_status, headers, body = answer
    facts = error_facts(got_status, headers, body)
    record.outputs[label] = facts
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        record.notes[f"{label}_message"] = str(body["error"].get("message"))[:300]
    record.check(got_status == status, f"{label}: HTTP {got_status}, expected {status}")
    record.check(is_error_shape(body), f"{label}: not the error shape: {str(body)[:200]}")
    record.check(facts["code"] in codes, f"{label}: code {facts['code']!r}, expected {codes}")
    if param is not None:
        record.check(facts["param"] == param, f"{label}: param {facts['param']!r} != {param!r}")
    retry = facts["headers"]
    if status in SHOULD_RETRY:
        record.check(retry["x-should-retry"] == "true", f"{label}: x-should-retry {retry}")
        record.check(retry["retry-after"] == "seconds>=1", f"{label}: Retry-After {retry}")
    elif 400 <= status < 500:
        record.check(retry["x-should-retry"] == "false", f"{label}: x-should-retry {retry}")
    return facts


def _accepted(record: CaseRecord, answer: tuple[int, dict[str, str], Any], reason: str) -> None:
    """The server answered 200 where the case needs a refusal it cannot be made to give."""
    if answer[0] == 200:
        record.unsupported(reason, answer[2] if isinstance(answer[2], dict) else None)


@case("error-unknown-parameter", "an unknown field is 400 unknown_parameter naming it")
def unknown_parameter(s: Session, record: CaseRecord) -> None:
    body = chat_body(s, "hi", max_tokens=1, not_a_parameter=1)
    answer = raw_post(s, record, "request", CHAT, body)
    expect_error(record, "error", answer, 400, ("unknown_parameter",), "not_a_parameter")


@case(
    "error-unsupported-parameter",
    "a known field that would change output but is not supported is 400 unsupported_parameter",
)
def unsupported_parameter(s: Session, record: CaseRecord) -> None:
    body = chat_body(s, "hi", max_tokens=1, logit_bias={"5": 10})
    answer = raw_post(s, record, "request", CHAT, body)
    _accepted(record, answer, "the server takes logit_bias (supported, nothing to refuse)")
    expect_error(record, "error", answer, 400, ("unsupported_parameter",), "logit_bias")


@case("error-malformed-request", "a body that is not JSON, or of the wrong type, is 400")
def malformed_request(s: Session, record: CaseRecord) -> None:
    answer = raw_post(s, record, "not_json", CHAT, b'{"model": ')
    expect_error(record, "not_json", answer, 400, ("invalid_request",))
    body = {"model": s.model, "messages": "not a list", "max_tokens": 1}
    answer = raw_post(s, record, "wrong_type", CHAT, body)
    expect_error(record, "wrong_type", answer, 400, ("invalid_request",), "messages")


REMOTE_REF_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "http://example.com/a"}}}


@case(
    "error-invalid-grammar",
    "a schema that cannot be enforced exactly is 400 invalid_grammar, never widened",
)
def invalid_grammar(s: Session, record: CaseRecord) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "remote", "schema": REMOTE_REF_SCHEMA}}
    body = chat_body(s, "hi", max_tokens=4, response_format=fmt)
    answer = raw_post(s, record, "request", CHAT, body)
    expect_error(record, "error", answer, 400, ("invalid_grammar",))


@case("error-model-not-found", "an unknown model is 404 model_not_found")
def model_not_found(s: Session, record: CaseRecord) -> None:
    body = {**chat_body(s, "hi", max_tokens=1), "model": "no-such-model-conformance"}
    answer = raw_post(s, record, "request", CHAT, body)
    expect_error(record, "error", answer, 404, ("model_not_found",), "model")


@case("error-route", "an unknown route is 404 not_found; a wrong method 405 with Allow")
def unknown_route(s: Session, record: CaseRecord) -> None:
    r = s.http.get("/v1/no-such-route")
    record.inputs["unknown_route"] = "GET /v1/no-such-route"
    expect_error(record, "unknown_route", (r.status_code, dict(r.headers), _json(r)), 404,
                 ("not_found",))  # fmt: skip
    r = s.http.get(CHAT)
    record.inputs["wrong_method"] = f"GET {CHAT}"
    facts = expect_error(
        record, "wrong_method", (r.status_code, dict(r.headers), _json(r)), 405,
        ("method_not_allowed",),
    )  # fmt: skip
    allow = facts["headers"]["allow"] or []
    record.check("POST" in allow, f"wrong_method: Allow {allow} does not list POST")


def _json(r) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text[:500]


@case("error-context-length", "a prompt longer than the context is 400 context_length_exceeded")
def context_length(s: Session, record: CaseRecord) -> None:
    if s.max_model_len is None:
        record.unsupported("the server states no max_model_len (server_info or /v1/models)")
    # Every " harbour" is at least one token.
    prompt = "harbour" + " harbour" * (s.max_model_len + 16)
    answer = raw_post(s, record, "request", COMPLETIONS, completion_body(s, prompt, max_tokens=1))
    record.inputs["request"] = {"prompt": f"'harbour' x {s.max_model_len + 17}", "max_tokens": 1}
    expect_error(record, "error", answer, 400, ("context_length_exceeded",))


@case(
    "error-max-tokens-exceeded",
    "max_tokens beyond the context is 400 (max_tokens_exceeded or context_length_exceeded)",
)
def max_tokens_exceeded(s: Session, record: CaseRecord) -> None:
    if s.max_model_len is None:
        record.unsupported("the server states no max_model_len (server_info or /v1/models)")
    body = completion_body(s, "hi", max_tokens=s.max_model_len * 2)
    answer = raw_post(s, record, "request", COMPLETIONS, body)
    codes = ("max_tokens_exceeded", "context_length_exceeded")
    expect_error(record, "error", answer, 400, codes)


@case("error-body-too-large", "a body over the stated max_body_bytes is 413 body_too_large")
def body_too_large(s: Session, record: CaseRecord) -> None:
    limit = s.limit("max_body_bytes")
    if not isinstance(limit, int):
        record.unsupported("the server states no max_body_bytes (server_info limits)")
    body = chat_body(s, "x" * (limit + 1024), max_tokens=1)
    answer = raw_post(s, record, "request", CHAT, body)
    record.inputs["request"] = {"content": f"'x' x {limit + 1024}", "max_tokens": 1}
    expect_error(record, "error", answer, 413, ("body_too_large",))


@case(
    "error-deadline-too-short",
    "a deadline no idle server could meet (X-Request-Timeout-Ms: 1, a 300-word prompt) is "
    "400 deadline_too_short",
)
def deadline_too_short(s: Session, record: CaseRecord) -> None:
    # A prompt long enough that its prefill alone takes more than 1 ms on any machine (a
    # short one may not, with a small model on a fast CPU).
    body = completion_body(s, "hi " * 300, max_tokens=8)
    answer = raw_post(s, record, "request", COMPLETIONS, body, {"X-Request-Timeout-Ms": "1"})
    _accepted(record, answer, "the server served a 1 ms deadline (X-Request-Timeout-Ms ignored?)")
    facts = expect_error(record, "error", answer, 400, ("deadline_too_short",))
    # The request set its deadline in the header only: the error names the header.
    record.check(facts["param"] == "X-Request-Timeout-Ms", f"param {facts['param']!r}")


@case("error-auth", "a wrong API key is 401 invalid_api_key with WWW-Authenticate")
def auth(s: Session, record: CaseRecord) -> None:
    body = chat_body(s, "hi", max_tokens=1)
    headers = {"Authorization": "Bearer sk-conformance-not-a-key"}
    answer = raw_post(s, record, "request", CHAT, body, headers)
    _accepted(record, answer, "the server takes any key (no API keys configured)")
    facts = expect_error(record, "error", answer, 401, ("invalid_api_key",))
    record.check(
        (facts["headers"]["www-authenticate"] or "").lower().startswith("bearer"),
        "no WWW-Authenticate: Bearer",
    )


@case(
    "error-concurrency-limit",
    "past a key's max_concurrent_requests: 429 concurrency_limit with Retry-After",
)
def concurrency_limit(s: Session, record: CaseRecord) -> None:
    key = s.target.limited_key
    if not key:
        record.unsupported("needs --limited-key, a key with max_concurrent_requests: 1")
    headers = {"Authorization": f"Bearer {key}"}
    first = s.open_stream(
        CHAT, long_output(s, chat_body(s, "Tell a long story.", stream=True), 200), headers
    )
    try:
        if first.stream.status != 200:
            record.fail(f"the limited key's first request: HTTP {first.stream.status}")
        first.read_outputs(1)
        answer = raw_post(s, record, "request", CHAT, chat_body(s, "hi", max_tokens=1), headers)
        expect_error(record, "error", answer, 429, ("concurrency_limit",))
    finally:
        first.close()


# The drain reaches every ingress within this (each reads the flag at most twice a second).
DRAIN_REACHES_WITHIN_S = 5.0


@case("error-overloaded", "a draining server refuses new work: 503 overloaded with Retry-After")
def overloaded(s: Session, record: CaseRecord) -> None:
    if not s.target.admin_url:
        record.unsupported("needs --admin-url (the admin drain)")
    r = s.admin_post("/admin/v1/drain", {"draining": True})
    if r.status_code != 200:
        record.unsupported(f"the admin drain answered HTTP {r.status_code}", _json(r))
    body = chat_body(s, "hi", max_tokens=1)
    try:
        answer, seconds = _poll(s, record, body, lambda status: status != 200)
        record.timings["refused_after_s"] = seconds
    finally:
        s.admin_post("/admin/v1/drain", {"draining": False})
    expect_error(record, "error", answer, 503, ("overloaded",))
    after, seconds = _poll(s, record, body, lambda status: status == 200)
    record.timings["served_again_after_s"] = seconds
    record.check(after[0] == 200, f"after the drain was lifted: HTTP {after[0]}")


def _poll(s: Session, record: CaseRecord, body: dict, done) -> tuple[tuple, float]:
    """Send `body` until `done(status)` or DRAIN_REACHES_WITHIN_S: the last answer, seconds."""
    started = time.monotonic()
    while True:
        answer = raw_post(s, record, "request", CHAT, body)
        elapsed = time.monotonic() - started
        if done(answer[0]) or elapsed > DRAIN_REACHES_WITHIN_S:
            return answer, round(elapsed, 3)
        time.sleep(0.1)


@case("error-internal", "an internal error is 500 internal_error in the error shape")
def internal(s: Session, record: CaseRecord) -> None:
    faults = (s.server_info or {}).get("fault_injection") or {}
    if not faults.get("enabled") or "internal_error" not in (faults.get("faults") or ()):
        record.unsupported(
            "no request can make a healthy server fail inside; this needs a server started "
            "with a fault-injection setting that answers 500 (/v1/server_info: fault_injection)"
        )
    body = chat_body(s, "hi", max_tokens=1)
    headers = {faults.get("header") or "X-Fault-Injection": "internal_error"}
    answer = raw_post(s, record, "request", CHAT, body, headers)
    facts = expect_error(record, "error", answer, 500, ("internal_error",))
    # A 500 says whether a repeat is safe: the official client retries 5xx by itself unless
    # told `x-should-retry: false` (docs/contract.md#retry-headers).
    stated = facts["headers"]["x-should-retry"]
    record.check(stated in ("true", "false"), f"error: x-should-retry {stated!r} not stated")
    after = raw_post(s, record, "after", CHAT, body)
    record.observation["served_after_the_fault"] = after[0] == 200
    record.check(after[0] == 200, f"after the fault: HTTP {after[0]}, the server stopped serving")


@case(
    "error-model-not-permitted",
    "a key that may not use the model is 403 model_not_permitted, and /v1/models hides it",
)
def model_not_permitted(s: Session, record: CaseRecord) -> None:
    key = s.target.restricted_key
    if not key:
        record.unsupported("needs --restricted-key, a key whose models leave out the served one")
    headers = {"Authorization": f"Bearer {key}"}
    answer = raw_post(s, record, "request", CHAT, chat_body(s, "hi", max_tokens=1), headers)
    expect_error(record, "error", answer, 403, ("model_not_permitted",))
    r = s.http.get("/v1/models", headers=headers)
    listed = [m.get("id") for m in (_json(r) or {}).get("data") or []] if r.is_success else None
    record.outputs["models_listed"] = {"status": r.status_code, "value": listed}
    record.check(r.status_code == 200, f"/v1/models for the restricted key: HTTP {r.status_code}")
    record.check(s.model not in (listed or []), f"/v1/models lists {s.model} to a key without it")
