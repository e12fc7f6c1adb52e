"""The suite against this server (the session's tiny llama): a clean run has no contract
violation; and records of deliberately changed servers (a rewriting proxy in front of the same
server) diff as the rules say: a template change is intended through its hash, a changed error
code is a regression even beside new weights, logprobs moved by 1e-6 are numerical and by 1e-2
a regression, a swapped event order is a regression, a declared new field is intended."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest

from serve_app.cli import main
from serve_app.conformance.cases import select
from serve_app.conformance.changes import load_changes
from serve_app.conformance.diff import diff_records
from serve_app.conformance.differences import Classification, DiffReport
from serve_app.conformance.record import Record
from serve_app.conformance.runner import run_suite
from serve_app.conformance.session import Target
from tests.support.rewriting_proxy import Rewrite, rewriting_proxy, walk_logprobs

pytestmark = pytest.mark.serve

# What an open server without a fault-injection setting cannot be made to show (the keyed
# server of test_keyed_server.py shows them).
UNSUPPORTED_HERE = {
    "error-auth",
    "error-concurrency-limit",
    "error-internal",
    "error-model-not-permitted",
}
# The cases the changed servers are run on (a proxy buffers streams: no lifecycle cases).
PROXIED = [
    "server-info",
    "stream-equals-nonstream-chat",
    "stream-equals-nonstream-completions",
    "stream-event-order",
    "stop-string-excluded",
    "max-tokens-length",
    "logprobs-chat",
    "logprobs-completions",
    "json-schema-valid",
    "tool-call-deltas",
    "error-unknown-parameter",
    "error-model-not-found",
]


@pytest.fixture(scope="module")
def baseline(serve_url, admin_url) -> Record:
    """The fast subset against the session's server, with its admin port."""
    return run_suite(Target(serve_url, admin_url=admin_url), select(fast=True))


def test_a_clean_run_has_no_contract_violation(baseline):
    verdicts = {c["id"]: c["verdict"] for c in baseline.cases}
    violations = {c["id"]: c["violations"] for c in baseline.cases if c["verdict"] == "violation"}
    assert violations == {}
    assert {k for k, v in verdicts.items() if v == "unsupported"} == UNSUPPORTED_HERE
    assert sum(v == "pass" for v in verdicts.values()) >= 30
    # Identity from /v1/server_info; token ids recorded where the server returns them.
    assert baseline.server["identity"]["weights_sha256"]
    generation = baseline.case("stream-equals-nonstream-chat")["outputs"]["generation"]
    assert generation["token_ids"] and generation["logprobs"][0]["top"]
    # Held to a baseline through the admin port, not just "it answered".
    assert baseline.case("cancellation")["observation"]["back_to_baseline"] is True
    # The task family: a retrievable resource, a replay under its key, a settled cancel.
    assert baseline.case("generations-resource")["observation"]["retrieved_equal"] is True
    assert baseline.case("generations-idempotency")["observation"]["same_resource"] is True
    assert baseline.case("generations-cancel")["observation"]["repeat_unchanged"] is True
    limit = baseline.case("error-generation-limit")["outputs"]["error"]
    assert (limit["status"], limit["code"]) == (422, "max_tokens_exceeded")
    # The Responses family: the typed stream in order, agreeing with every other read of it.
    streamed = baseline.case("responses-stream")
    assert streamed["observation"]["order_problems"] == []
    assert streamed["observation"]["stored_equals_terminal"] is True
    assert streamed["outputs"]["event_kinds"][:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert baseline.case("responses-chain")["observation"]["chain_in_context"] is True


def test_the_command_writes_a_record(serve_url, tmp_path):
    out = tmp_path / "run.json"
    argv = ["conformance", "run", "--base-url", f"{serve_url}/v1", "--out", str(out)]
    assert main([*argv, "--case", "models-list", "--case", "error-route"]) == 0
    record = json.loads(out.read_text())
    assert [c["id"] for c in record["cases"]] == ["models-list", "error-route"]
    assert record["counts"] == {"pass": 2, "violation": 0, "unsupported": 0}
    assert record["server"]["identity"]["chat_template_sha256"]


# ------------------------------------------------------------------ changed servers


def run_changed(serve_url: str, rewrite: Rewrite) -> Record:
    with rewriting_proxy(serve_url, rewrite) as url:
        return run_suite(Target(url), select(PROXIED))


def only(record: Record, ids: list[str]) -> Record:
    subset = copy.deepcopy(record)
    subset.cases = [c for c in subset.cases if c["id"] in ids]
    return subset


def diff(baseline: Record, new: Record, changes_text: str = "", tmp_path=None) -> DiffReport:
    changes = []
    if changes_text:
        path = tmp_path / "api_changes.yaml"
        path.write_text(changes_text)
        changes = load_changes(path)
    return diff_records(only(baseline, PROXIED), new, changes)


def kinds(report: DiffReport, classification: Classification) -> set[tuple[str, str]]:
    return {(d.case, d.kind) for d in report.differences if d.classification == classification}


def test_a_second_run_through_an_unchanged_proxy_differs_only_numerically(serve_url, baseline):
    """The same server twice: the same statuses, shapes, events and tokens. Logprobs may move
    in the last digits (a request's batch mates differ from run to run; seeded tokens do not
    change), which the diff calls numerical variation."""
    report = diff(baseline, run_changed(serve_url, Rewrite()))
    numerical = Classification.NUMERICAL
    assert [d.as_dict() for d in report.differences if d.classification != numerical] == []
    assert {d.kind for d in report.differences} <= {"logprobs"}


NEW_TEMPLATE_HASH = hashlib.sha256(b"a template with a system turn").hexdigest()


def _template_request(path: str, body):
    # What a template that renders a system turn does to every chat prompt.
    if path.endswith("/chat/completions"):
        system = {"role": "system", "content": "You are the harbour master's assistant."}
        body = {**body, "messages": [system, *body["messages"]]}
    return body


def _template_answer(path: str, status: int, body):
    if path.endswith("/server_info"):
        body["artifact"]["chat_template_sha256"] = NEW_TEMPLATE_HASH
    return body


def test_a_changed_chat_template_is_intended_through_its_hash(serve_url, baseline, tmp_path):
    new = run_changed(serve_url, Rewrite(request=_template_request, answer=_template_answer))
    declared = (
        "changes:\n- description: the template renders a system turn\n  kind: identity\n"
        f"  key: chat_template_sha256\n  new: {NEW_TEMPLATE_HASH}\n"
    )
    report = diff(baseline, new, declared, tmp_path)
    assert not report.has_regression, [d.as_dict() for d in report.differences]
    intended = kinds(report, Classification.INTENDED)
    assert ("server", "identity") in intended
    # The new prompt changed what the model wrote, and the hash is what explains it.
    assert ("stream-equals-nonstream-chat", "divergence") in intended
    assert ("stream-equals-nonstream-chat", "token_count") in intended
    # Undeclared, the same records are a regression (an artifact changed without a word).
    assert diff(baseline, new).has_regression


def test_a_changed_error_code_is_a_regression_even_with_new_weights(serve_url, baseline, tmp_path):
    def answer(path: str, status: int, body):
        if path.endswith("/server_info"):
            body["artifact"]["weights_sha256"] = "0" * 64
        if status == 400 and body.get("error", {}).get("code") == "unknown_parameter":
            body["error"]["code"] = "invalid_request"
        return body

    new = run_changed(serve_url, Rewrite(answer=answer))
    declared = "changes:\n- {description: new weights, kind: identity, key: weights_sha256}\n"
    report = diff(baseline, new, declared, tmp_path)
    assert report.has_regression
    assert ("error-unknown-parameter", "code") in kinds(report, Classification.REGRESSION)
    assert ("server", "identity") in kinds(report, Classification.INTENDED)


def _move_logprobs(delta: float) -> Rewrite:
    return Rewrite(
        answer=lambda path, status, body: walk_logprobs(body, delta),
        stream=lambda path, events: [walk_logprobs(e, delta) for e in events],
    )


def test_logprobs_moved_by_1e6_are_numerical_variation(serve_url, baseline):
    report = diff(baseline, run_changed(serve_url, _move_logprobs(1e-6)))
    assert not report.has_regression, [d.as_dict() for d in report.differences]
    assert ("logprobs-chat", "logprobs") in kinds(report, Classification.NUMERICAL)
    assert {d.kind for d in report.differences} == {"logprobs"}


def test_logprobs_moved_by_1e2_are_a_regression(serve_url, baseline):
    report = diff(baseline, run_changed(serve_url, _move_logprobs(1e-2)))
    regressions = kinds(report, Classification.REGRESSION)
    assert ("logprobs-chat", "logprobs") in regressions
    assert ("logprobs-completions", "logprobs") in regressions


def _swap_usage_and_finish(path: str, events: list) -> list:
    """The usage chunk sent before the last finish chunk instead of after it."""
    usage = [i for i, e in enumerate(events) if isinstance(e, dict) and e.get("usage")]
    if usage:
        i = usage[-1]
        events[i - 1], events[i] = events[i], events[i - 1]
    return events


def test_a_swapped_event_order_is_a_regression(serve_url, baseline):
    new = run_changed(serve_url, Rewrite(stream=_swap_usage_and_finish))
    report = diff(baseline, new)
    regressions = kinds(report, Classification.REGRESSION)
    assert ("stream-event-order", "event_order") in regressions
    assert ("stream-event-order", "verdict") in regressions
    assert new.case("stream-event-order")["verdict"] == "violation"


def _annotate(path: str, status: int, body):
    if path.endswith("/chat/completions") and status == 200:
        for choice in body["choices"]:
            choice["message"]["annotations"] = []
    return body


def test_an_added_field_declared_in_the_changes_file_is_intended(serve_url, baseline, tmp_path):
    new = run_changed(serve_url, Rewrite(answer=_annotate))
    declared = (
        "changes:\n- description: chat messages carry annotations\n  kind: field_added\n"
        "  field: 'choices[].message.annotations*'\n"
    )
    report = diff(baseline, new, declared, tmp_path)
    assert not report.has_regression, [d.as_dict() for d in report.differences]
    added = {d.subject for d in report.differences if d.classification != Classification.NUMERICAL}
    assert added == {"choices[].message.annotations"}
    assert kinds(report, Classification.INTENDED) >= {("logprobs-chat", "field_added")}
    undeclared = diff(baseline, new)
    assert ("logprobs-chat", "field_added") in kinds(undeclared, Classification.REGRESSION)


def test_without_the_setting_the_fault_header_changes_nothing(serve_url):
    import httpx

    info = httpx.get(f"{serve_url}/v1/server_info", timeout=30).json()
    assert info["fault_injection"] == {"enabled": False}
    body = {"prompt": "hi", "max_tokens": 1, "model": info["model"]}
    r = httpx.post(
        f"{serve_url}/v1/completions",
        json=body,
        headers={"X-Fault-Injection": "internal_error"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
