"""The diff's rules on small hand-made records (test doubles of two runs): what each kind of
difference is classified as, the changes file, the report and the command's exit status."""

from __future__ import annotations

import copy
import json

import pytest

from serve_app.cli import main
from serve_app.conformance.changes import ChangesError, load_changes
from serve_app.conformance.diff import diff_records
from serve_app.conformance.differences import Classification
from serve_app.conformance.divergence import compare_generations
from serve_app.conformance.record import Record
from serve_app.conformance.report import write_report

INTENDED, NUMERICAL, REGRESSION = (
    Classification.INTENDED,
    Classification.NUMERICAL,
    Classification.REGRESSION,
)
IDENTITY = {"weights_sha256": "w1", "tokenizer_sha256": "t1", "chat_template_sha256": "c1"}


def generation(ids, gaps, greedy=True, base=-1.0, text=None):
    """A generation whose token i has logprob `base` and, `gaps[i]` nats below, the runner-up
    token `t{ids[i] + 100}`."""
    logprobs = [
        {"token": f"t{t}", "logprob": base, "top": [[f"t{t}", base], [f"t{t + 100}", base - gap]]}
        for t, gap in zip(ids, gaps, strict=True)
    ]
    return {
        "text": text if text is not None else "".join(f"t{t}" for t in ids),
        "token_ids": list(ids),
        "finish_reason": "length",
        "stop_reason": None,
        "logprobs": logprobs,
        "greedy": greedy,
    }


def case(case_id, verdict="pass", **outputs):
    return {
        "id": case_id,
        "title": case_id,
        "verdict": verdict,
        "violations": [] if verdict != "violation" else ["broken"],
        "observation": {},
        "inputs": {"request": {"model": "m", "max_tokens": 4}},
        "outputs": outputs,
        "timings": {"total_s": 0.5},
        "server_answer": None,
        "notes": {},
    }


def record(*cases, identity=IDENTITY):
    return Record(
        server={"base_url": "http://x", "model": "m", "identity": dict(identity)},
        cases=[copy.deepcopy(c) for c in cases],
        suite={"version": 1},
    )


GEN = generation([5, 6, 7, 8], [0.5, 0.3, 0.01, 0.4])
ERROR = {"status": 400, "code": "unknown_parameter", "type": "invalid_request_error",
         "param": "x", "headers": {"x-should-retry": "false", "retry-after": None}}  # fmt: skip


def classes(report):
    return [(d.case, d.kind, d.classification) for d in report.differences]


def test_the_same_record_has_no_difference():
    old = record(case("a", generation=GEN), case("e", error=ERROR))
    report = diff_records(old, record(*old.cases), [])
    assert report.differences == [] and not report.has_regression
    assert report.identical_cases == ["a", "e"]


def test_timings_are_reported_never_classified():
    old = record(case("a", generation=GEN))
    new = copy.deepcopy(old)
    new.cases[0]["timings"] = {"total_s": 9.0}
    report = diff_records(old, new, [])
    assert report.differences == []
    assert [(t.case, t.old, t.new) for t in report.timings] == [("a", 0.5, 9.0)]


@pytest.mark.parametrize(("delta", "expected"), [(1e-6, NUMERICAL), (1e-2, REGRESSION)])
def test_logprobs_perturbed(delta, expected):
    moved = copy.deepcopy(GEN)
    for entry in moved["logprobs"]:
        entry["logprob"] += delta
        entry["top"] = [[t, v + delta] for t, v in entry["top"]]
    report = diff_records(
        record(case("a", generation=GEN)), record(case("a", generation=moved)), []
    )
    assert classes(report) == [("a", "logprobs", expected)]


def test_a_greedy_divergence_after_a_near_tie_is_numerical():
    # Token 2's runner-up was 0.01 nats behind: the new run took it, and went on differently.
    other = generation([5, 6, 107, 10, 11], [0.5, 0.3, 0.01, 0.2, 0.2])
    old = record(case("a", generation=GEN, usage={"completion_tokens": 4}))
    new = record(case("a", generation=other, usage={"completion_tokens": 5}))
    report = diff_records(old, new, [])
    assert classes(report) == [("a", "divergence", NUMERICAL), ("a", "token_count", NUMERICAL)]
    assert "token 2" in report.differences[0].reason


def test_a_greedy_divergence_without_a_near_tie_is_a_regression():
    other = generation([5, 106, 9, 9], [0.5, 0.3, 0.01, 0.4])  # the runner-up, 0.3 nats behind
    report = diff_records(
        record(case("a", generation=GEN)), record(case("a", generation=other)), []
    )
    assert classes(report) == [("a", "divergence", REGRESSION)]
    assert "without a near-tie" in report.differences[0].reason


def test_a_divergence_to_a_token_that_was_not_the_runner_up_is_a_regression():
    # Token 2 was a near-tie, but the new run took neither of its two candidates.
    other = generation([5, 6, 9, 9], [0.5, 0.3, 0.01, 0.4])
    report = diff_records(
        record(case("a", generation=GEN)), record(case("a", generation=other)), []
    )
    assert classes(report) == [("a", "divergence", REGRESSION)]
    assert "runner-up" in report.differences[0].reason


def test_a_sampled_divergence_is_a_regression_even_at_a_near_tie():
    a = generation([5, 6, 7, 8], [0.5, 0.3, 0.01, 0.4], greedy=False)
    b = generation([5, 6, 107, 9], [0.5, 0.3, 0.01, 0.4], greedy=False)
    report = diff_records(record(case("a", generation=a)), record(case("a", generation=b)), [])
    assert classes(report) == [("a", "divergence", REGRESSION)]


def test_logprobs_before_a_near_tie_divergence_must_still_agree():
    other = generation([5, 6, 107, 10], [0.5, 0.3, 0.01, 0.2], base=-1.5)
    report = diff_records(
        record(case("a", generation=GEN)), record(case("a", generation=other)), []
    )
    assert ("a", "logprobs", REGRESSION) in classes(report)


def test_an_identity_change_explains_text_never_an_error_code():
    other = generation([5, 9, 9, 9], [0.5, 0.3, 0.3, 0.3])
    changed_code = {**ERROR, "code": "invalid_request"}
    old = record(case("a", generation=GEN), case("e", error=ERROR))
    new = record(
        case("a", generation=other),
        case("e", error=changed_code),
        identity={**IDENTITY, "weights_sha256": "w2"},
    )
    declared = load_changes_text(
        "changes:\n- {description: new weights, kind: identity, key: weights_sha256, new: w2}\n"
    )
    report = diff_records(old, new, declared)
    assert classes(report) == [
        ("server", "identity", INTENDED),
        ("a", "divergence", INTENDED),
        ("e", "code", REGRESSION),
    ]
    assert report.has_regression


def test_an_undeclared_identity_change_is_a_regression():
    new = record(case("a", generation=GEN), identity={**IDENTITY, "chat_template_sha256": "c2"})
    report = diff_records(record(case("a", generation=GEN)), new, [])
    assert classes(report) == [("server", "identity", REGRESSION)]


def test_an_added_field_is_intended_only_when_declared():
    old = record(case("a", shape={"request": ["choices", "choices[].message"]}))
    new = record(case("a", shape={"request": ["choices", "choices[].message", "choices[].x"]}))
    assert classes(diff_records(old, new, [])) == [("a", "field_added", REGRESSION)]
    declared = load_changes_text(
        "changes:\n- description: x names the thing\n  kind: field_added\n  field: 'choices[].x'\n"
    )
    report = diff_records(old, new, declared)
    assert classes(report) == [("a", "field_added", INTENDED)]
    assert report.differences[0].reason == "declared: x names the thing"
    assert report.declared_not_seen == []


def test_a_swapped_event_order_is_a_regression():
    events = {
        "stream": ["choice", "usage", "[DONE]"],
        "choices": {"0": ["role", "delta", "finish"]},
    }
    swapped = {"stream": ["choice", "usage", "choice", "[DONE]"], "choices": events["choices"]}
    old = record(case("o", events=events))
    new = record(case("o", "violation", events=swapped))
    assert classes(diff_records(old, new, [])) == [
        ("o", "verdict", REGRESSION),
        ("o", "event_order", REGRESSION),
    ]


def test_a_verdict_that_became_unsupported_is_one_regression():
    old = record(case("a", generation=GEN))
    new = record(case("a", "unsupported"))
    assert classes(diff_records(old, new, [])) == [("a", "verdict", REGRESSION)]


def test_a_case_missing_from_one_record_is_a_regression():
    report = diff_records(record(case("a"), case("b")), record(case("a")), [])
    assert classes(report) == [("b", "case_removed", REGRESSION)]


def test_violations_in_both_records_are_listed_not_diffed():
    old = record(case("a", "violation"))
    report = diff_records(old, record(*old.cases), [])
    assert report.differences == [] and report.violations_in_both == {"a": ["broken"]}


def test_compare_generations_without_token_ids_uses_the_logprob_tokens():
    a, b = copy.deepcopy(GEN), generation([5, 6, 107, 9], [0.5, 0.3, 0.01, 0.4])
    a["token_ids"] = b["token_ids"] = None
    (d,) = compare_generations("a", "outputs.generation", a, b)
    assert d.kind == "divergence" and d.classification == NUMERICAL


# ------------------------------------------------------------------ the changes file


def load_changes_text(text):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "changes.yaml"
        path.write_text(text)
        return load_changes(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("changes:\n- {kind: identity}\n", "description"),
        ("changes:\n- {description: d, kind: nonsense}\n", "kind"),
        ("changes:\n- {description: d, kind: code, colour: red}\n", "unknown fields"),
        ("changes: 3\n", "changes"),
    ],
)
def test_a_bad_changes_file_names_what_is_wrong(text, message):
    with pytest.raises(ChangesError, match=message):
        load_changes_text(text)


def test_the_projects_changes_file_loads():
    assert isinstance(load_changes(), list)


# ------------------------------------------------------------------ report and command


def test_the_report_and_the_exit_status(tmp_path, capsys):
    old = record(case("a", generation=GEN), case("e", error=ERROR))
    new = record(case("a", generation=GEN), case("e", error={**ERROR, "status": 422}))
    old.save(tmp_path / "old.json")
    new.save(tmp_path / "new.json")
    md, js = write_report(diff_records(old, new, []), tmp_path / "report")
    assert "| e | outputs.error.status | status | 400 | 422 | **regression** |" in md.read_text()
    assert json.loads(js.read_text())["has_regression"] is True

    argv = ["conformance", "diff", str(tmp_path / "old.json"), str(tmp_path / "new.json")]
    assert main([*argv, "--out", str(tmp_path / "r1")]) == 1
    assert "REGRESSION: 1 differences" in capsys.readouterr().err
    same = ["conformance", "diff", str(tmp_path / "old.json"), str(tmp_path / "old.json")]
    assert main([*same, "--out", str(tmp_path / "r2")]) == 0
    assert (tmp_path / "r2.md").is_file() and (tmp_path / "r2.json").is_file()
    assert main([*argv, "--changes", str(tmp_path / "missing.yaml"), "--out", "x"]) == 2
