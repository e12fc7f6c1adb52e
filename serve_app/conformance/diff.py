"""Two records, case by case: every difference classified.

- **intended API change**: declared in the changes file; or a difference in text, token ids,
  logprobs, token counts or a case's model-derived inputs that a served-identity change the
  records show explains (weights, tokenizer, template, grammar backend, parsers). Such a change
  never explains a status, code, header, event order, field shape or verdict.
- **allowed numerical variation**: what `divergence` allows (logprobs within 1e-4, greedy outputs
  that part ways only after a near-tie), with what follows from it in the same case (later
  tokens, text, counts, derived inputs).
- **regression**: anything else.

Timings are reported, never classified; chunk boundaries are never recorded, so never compared.
"""

from __future__ import annotations

from typing import Any

from serve_app.conformance.changes import DeclaredChange
from serve_app.conformance.differences import Classification, Difference, DiffReport, Timing
from serve_app.conformance.divergence import compare_generations
from serve_app.conformance.record import Record, Verdict

# A served-identity change explains these kinds (what the model computes), never others.
EXPLAINED_BY_IDENTITY = {"text", "token_ids", "logprobs", "token_count", "divergence", "inputs"}
# A near-tie divergence in a case explains these in the rest of that case.
EXPLAINED_BY_DIVERGENCE = {"token_count", "inputs"}
# Leaf keys whose kind their name says.
KEY_KINDS = {
    "status": "status",
    "code": "code",
    "type": "code",
    "param": "code",
    "events": "event_order",
    "finish_reason": "finish_reason",
    "stop_reason": "finish_reason",
}


def diff_records(old: Record, new: Record, changes: list[DeclaredChange]) -> DiffReport:
    report = DiffReport(old=_side(old), new=_side(new))
    if old.suite.get("version") != new.suite.get("version"):
        report.notes.append(
            f"suite versions differ ({old.suite.get('version')} vs {new.suite.get('version')}): "
            "case inputs may differ for that reason alone"
        )
    identity = _identity_differences(old, new)
    identity_changed = bool(identity)
    found: list[Difference] = list(identity)
    for case_id in _case_ids(old, new):
        a, b = old.case(case_id), new.case(case_id)
        if a is None or b is None:
            kind = "case_added" if a is None else "case_removed"
            found.append(Difference(case_id, "", kind, _verdict(a), _verdict(b)))
            continue
        case_found = _case_differences(a, b)
        _classify_case(case_found, identity_changed)
        found.extend(case_found)
        if not case_found:
            report.identical_cases.append(case_id)
        if a["verdict"] == b["verdict"] == Verdict.VIOLATION:
            report.violations_in_both[case_id] = b.get("violations", [])
        report.timings.extend(_timings(case_id, a, b))
    used: set[int] = set()
    for d in found:
        _apply_declarations(d, changes, used)
    report.differences = found
    report.declared_not_seen = [c.as_dict() for i, c in enumerate(changes) if i not in used]
    return report


def _side(record: Record) -> dict[str, Any]:
    return {
        "server": record.server,
        "started_at": record.started_at,
        "suite": record.suite,
        "counts": record.counts(),
    }


def _case_ids(old: Record, new: Record) -> list[str]:
    ids = [c["id"] for c in old.cases]
    return ids + [c["id"] for c in new.cases if c["id"] not in ids]


def _verdict(case: dict[str, Any] | None) -> str | None:
    return None if case is None else case["verdict"]


# ------------------------------------------------------------------ identity


def _identity_differences(old: Record, new: Record) -> list[Difference]:
    a = old.server.get("identity") or {}
    b = new.server.get("identity") or {}
    out = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            out.append(
                Difference(
                    "server",
                    f"server.identity.{key}",
                    "identity",
                    a.get(key),
                    b.get(key),
                    reason="the served artifact changed",
                    subject=key,
                )
            )
    return out


# ------------------------------------------------------------------ one case


def _case_differences(a: dict[str, Any], b: dict[str, Any]) -> list[Difference]:
    case_id = a["id"]
    out: list[Difference] = []
    if a["verdict"] != b["verdict"]:
        why = "; ".join(b.get("violations") or []) or b.get("notes", {}).get("unsupported", "")
        out.append(
            Difference(case_id, "verdict", "verdict", a["verdict"], b["verdict"], reason=why)
        )
        # One of them observed nothing comparable (it was unsupported): the verdict says it.
        if Verdict.UNSUPPORTED in (a["verdict"], b["verdict"]):
            return out
    if _without_model(a.get("inputs")) != _without_model(b.get("inputs")):
        for path, x, y in _leaf_changes(a.get("inputs"), b.get("inputs"), "inputs"):
            out.append(Difference(case_id, path, "inputs", x, y))
    _walk(case_id, "observation", a.get("observation"), b.get("observation"), out, "observation")
    _walk(case_id, "outputs", a.get("outputs"), b.get("outputs"), out, None)
    return out


def _walk(case_id: str, path: str, x: Any, y: Any, out: list[Difference], kind: str | None):
    """Compare two recorded values; the key names say what kind of fact each one is."""
    if x == y:
        return
    key = path.rpartition(".")[2]
    if key == "generation" and isinstance(x, dict) and isinstance(y, dict):
        out.extend(compare_generations(case_id, path, x, y))
        return
    if key == "generations" and isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        for i, (gx, gy) in enumerate(zip(x, y, strict=True)):
            _walk(case_id, f"{path}[{i}].generation", gx, gy, out, kind)
        return
    if key == "shape" and isinstance(x, dict) and isinstance(y, dict):  # one per answer
        for label in sorted(set(x) | set(y)):
            _shape_changes(case_id, f"{path}.{label}", x.get(label) or [], y.get(label) or [], out)
        return
    if key == "shape" and isinstance(x, list) and isinstance(y, list):
        _shape_changes(case_id, path, x, y, out)
        return
    if key == "headers" and isinstance(x, dict) and isinstance(y, dict):
        for name in sorted(set(x) | set(y)):
            if x.get(name) != y.get(name):
                out.append(
                    Difference(case_id, f"{path}.{name}", "header", x.get(name), y.get(name))
                )
        return
    kind = kind or KEY_KINDS.get(key) or ("token_count" if ".usage" in path else None)
    if kind is None and isinstance(x, dict) and isinstance(y, dict):
        for name in sorted(set(x) | set(y)):
            _walk(case_id, f"{path}.{name}", x.get(name), y.get(name), out, None)
        return
    if kind == "observation" and isinstance(x, dict) and isinstance(y, dict):
        for name in sorted(set(x) | set(y)):
            _walk(case_id, f"{path}.{name}", x.get(name), y.get(name), out, kind)
        return
    out.append(Difference(case_id, path, kind or "value", x, y))


def _shape_changes(case_id: str, path: str, x: list, y: list, out: list[Difference]) -> None:
    for name in sorted(set(y) - set(x)):
        out.append(Difference(case_id, path, "field_added", None, name, subject=name))
    for name in sorted(set(x) - set(y)):
        out.append(Difference(case_id, path, "field_removed", name, None, subject=name))


def _classify_case(found: list[Difference], identity_changed: bool) -> None:
    """Classify what the generation comparison left open, in the light of the whole case."""
    diverged_on_tie = any(
        d.kind == "divergence" and d.classification == Classification.NUMERICAL for d in found
    )
    for d in found:
        if d.classification == Classification.NUMERICAL:
            continue  # the generation comparison found it within the allowed variation
        if identity_changed and d.kind in EXPLAINED_BY_IDENTITY:
            d.classification = Classification.INTENDED
            d.reason = "the served identity changed" + (f"; {d.reason}" if d.reason else "")
        elif diverged_on_tie and d.kind in EXPLAINED_BY_DIVERGENCE:
            d.classification = Classification.NUMERICAL
            d.reason = "follows from a generation that parted ways after a near-tie"
        elif not d.reason:
            d.reason = _regression_reason(d.kind)


def _regression_reason(kind: str) -> str:
    return {
        "verdict": "the case's verdict changed",
        "status": "a status changed",
        "code": "an error's code changed",
        "header": "a header changed",
        "event_order": "the event order changed",
        "field_added": "a field appeared",
        "field_removed": "a field disappeared",
        "observation": "a checked fact changed",
        "inputs": "the case's inputs differ",
        "case_added": "a case only the new record has",
        "case_removed": "a case only the old record has",
        "identity": "the served artifact changed",
    }.get(kind, "a value changed")


def _apply_declarations(d: Difference, changes: list[DeclaredChange], used: set[int]) -> None:
    for i, change in enumerate(changes):
        if change.matches(d.kind, d.case, d.path, d.subject or d.path, d.old, d.new):
            used.add(i)
            d.classification = Classification.INTENDED
            d.reason = f"declared: {change.description}"
            return


# ------------------------------------------------------------------ helpers


def _without_model(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_model(v) for k, v in value.items() if k != "model"}
    if isinstance(value, list):
        return [_without_model(v) for v in value]
    return value


def _leaf_changes(x: Any, y: Any, path: str) -> list[tuple[str, Any, Any]]:
    x, y = _without_model(x), _without_model(y)
    if isinstance(x, dict) and isinstance(y, dict):
        out = []
        for key in sorted(set(x) | set(y)):
            if x.get(key) != y.get(key):
                out.extend(_leaf_changes(x.get(key), y.get(key), f"{path}.{key}"))
        return out
    return [(path, x, y)]


def _timings(case_id: str, a: dict[str, Any], b: dict[str, Any]) -> list[Timing]:
    ta, tb = a.get("timings") or {}, b.get("timings") or {}
    return [Timing(case_id, name, ta.get(name), tb.get(name)) for name in sorted(set(ta) | set(tb))]
