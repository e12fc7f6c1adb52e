"""Two records, case by case: every difference classified.

- **intended API change**: declared in the changes file; or a difference in text, token ids,
  logprobs, token counts or a case's model-derived inputs that a served-identity change the
  records show explains (weights, tokenizer, template, grammar backend, parsers). Such a change
  never explains a status, code, header, event order, field shape or verdict.
- **allowed numerical variation**: logprobs within `LOGPROB_TOLERANCE`; greedy outputs that part
  ways only after a near-tie (at the first divergence one run took the other's runner-up, the
  top-2 gap below `NEAR_TIE_NATS`), with what follows from it in the same case (later tokens,
  text, counts, derived inputs).
- **regression**: anything else.

Timings are reported, never classified; chunk boundaries are never recorded, so never compared.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from serve_app.conformance.changes import DeclaredChange
from serve_app.conformance.record import Record, Verdict

LOGPROB_TOLERANCE = 1e-4
NEAR_TIE_NATS = 0.05
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


class Classification(StrEnum):
    INTENDED = "intended API change"
    NUMERICAL = "allowed numerical variation"
    REGRESSION = "regression"


@dataclass
class Difference:
    case: str
    path: str
    kind: str
    old: Any
    new: Any
    classification: Classification = Classification.REGRESSION
    reason: str = ""
    subject: str = ""  # the field of a field_added/removed, the key of an identity fact

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["classification"] = str(self.classification)
        return data


@dataclass
class Timing:
    case: str
    name: str
    old: float | None
    new: float | None


@dataclass
class DiffReport:
    old: dict[str, Any]
    new: dict[str, Any]
    differences: list[Difference] = field(default_factory=list)
    timings: list[Timing] = field(default_factory=list)
    identical_cases: list[str] = field(default_factory=list)
    violations_in_both: dict[str, list[str]] = field(default_factory=dict)
    declared_not_seen: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def has_regression(self) -> bool:
        return any(d.classification == Classification.REGRESSION for d in self.differences)

    def counts(self) -> dict[str, int]:
        out = {str(c): 0 for c in Classification}
        for d in self.differences:
            out[str(d.classification)] += 1
        return out

    def summary_line(self) -> str:
        counts = self.counts()
        verdict = "REGRESSION" if self.has_regression else "no regression"
        regressions = counts[Classification.REGRESSION]
        return (
            f"{verdict}: {len(self.differences)} differences "
            f"({counts[Classification.INTENDED]} intended, "
            f"{counts[Classification.NUMERICAL]} numerical, "
            f"{regressions} regression{'' if regressions == 1 else 's'})"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "old": self.old,
            "new": self.new,
            "has_regression": self.has_regression,
            "counts": self.counts(),
            "differences": [d.as_dict() for d in self.differences],
            "timings": [asdict(t) for t in self.timings],
            "identical_cases": self.identical_cases,
            "violations_in_both": self.violations_in_both,
            "declared_not_seen": self.declared_not_seen,
            "notes": self.notes,
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


# ------------------------------------------------------------------ generations


def compare_generations(
    case_id: str, path: str, x: dict[str, Any], y: dict[str, Any]
) -> list[Difference]:
    """Where two generations part ways, and whether a near-tie explains it."""
    at = _divergence(x, y)
    if at is None:
        return _same_tokens(case_id, path, x, y)
    out: list[Difference] = []
    before = _max_logprob_delta(x.get("logprobs"), y.get("logprobs"), upto=at)
    if before is not None and before > LOGPROB_TOLERANCE:
        out.append(_logprob_difference(case_id, path, before, f"before token {at}"))
    d = Difference(case_id, f"{path}.token_ids", "divergence", _excerpt(x), _excerpt(y))
    d.reason = _divergence_reason(x, y, at)
    if d.reason.startswith("greedy outputs part ways"):
        d.classification = Classification.NUMERICAL
    out.append(d)
    return out


def _divergence_reason(x: dict[str, Any], y: dict[str, Any], at: int) -> str:
    if at < 0:
        return "the texts differ (no tokens recorded to place the divergence)"
    if not (x.get("greedy") and y.get("greedy")):
        return f"sampled outputs parted ways at token {at}"
    xl, yl = x.get("logprobs"), y.get("logprobs")
    if xl is None or yl is None or at >= min(len(xl), len(yl)):
        return f"parted ways at token {at}; no logprobs there to judge a near-tie"
    gap = _swap_gap(xl[at], yl[at])
    if gap is None:
        return f"parted ways at token {at}; neither token was the other's runner-up"
    if gap < NEAR_TIE_NATS:
        return f"greedy outputs part ways at token {at} after a near-tie (top-2 gap {gap:.4f})"
    return f"parted ways at token {at} without a near-tie (top-2 gap {gap:.4f} nats)"


def _swap_gap(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    """The top-2 gap where the two runs took each other's runner-up at one position (the
    smaller of the two records' gaps); None when neither took the other's."""
    gaps = []
    for mine, other in ((a, b), (b, a)):
        top = mine.get("top") or []
        if (
            len(top) >= 2
            and top[0][0] == mine.get("token")
            and top[1][0] == other.get("token")
            and _finite(top[0][1])
            and _finite(top[1][1])
        ):
            gaps.append(top[0][1] - top[1][1])
    return min(gaps) if gaps else None


def _same_tokens(case_id: str, path: str, x: dict[str, Any], y: dict[str, Any]):
    out = []
    delta = _max_logprob_delta(x.get("logprobs"), y.get("logprobs"))
    if delta is not None and delta > 0:
        out.append(_logprob_difference(case_id, path, delta, "same tokens"))
    for key in ("text", "reasoning", "tool_calls", "finish_reason", "stop_reason"):
        if x.get(key) != y.get(key):
            kind = "finish_reason" if key in ("finish_reason", "stop_reason") else "text"
            out.append(Difference(case_id, f"{path}.{key}", kind, x.get(key), y.get(key)))
    has_x, has_y = x.get("logprobs") is not None, y.get("logprobs") is not None
    if has_x != has_y:
        out.append(Difference(case_id, f"{path}.logprobs", "value", has_x, has_y))
    return out


def _logprob_difference(case_id: str, path: str, delta: float, where: str) -> Difference:
    d = Difference(case_id, f"{path}.logprobs", "logprobs", None, round(delta, 9))
    d.old = f"max |Δ| {delta:.2e} ({where})"
    if delta <= LOGPROB_TOLERANCE:
        d.classification = Classification.NUMERICAL
        d.reason = f"logprobs within {LOGPROB_TOLERANCE:g} (max |Δ| {delta:.2e})"
    else:
        d.reason = f"logprobs differ by {delta:.2e} > {LOGPROB_TOLERANCE:g}"
    return d


def _sequence(gen: dict[str, Any]) -> list[Any] | None:
    if gen.get("token_ids") is not None:
        return list(gen["token_ids"])
    if gen.get("logprobs") is not None:
        return [e.get("token") for e in gen["logprobs"]]
    return None


def _divergence(x: dict[str, Any], y: dict[str, Any]) -> int | None:
    """The first token where the generations differ; None when the same; -1 when only the
    texts say they differ."""
    a, b = _sequence(x), _sequence(y)
    if a is None or b is None:
        same = x.get("text") == y.get("text") and x.get("tool_calls") == y.get("tool_calls")
        return None if same else -1
    for i, (p, q) in enumerate(zip(a, b, strict=False)):
        if p != q:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _max_logprob_delta(xl: list | None, yl: list | None, upto: int | None = None) -> float | None:
    """The largest difference between two logprob lists (chosen tokens and the alternatives
    both list), over the first `upto` tokens."""
    if xl is None or yl is None:
        return None
    n = min(len(xl), len(yl)) if upto is None else min(upto, len(xl), len(yl))
    worst = 0.0
    for a, b in zip(xl[:n], yl[:n], strict=True):
        if _finite(a.get("logprob")) and _finite(b.get("logprob")):
            worst = max(worst, abs(a["logprob"] - b["logprob"]))
        alternatives = {t: v for t, v in b.get("top") or []}
        for token, value in a.get("top") or []:
            if token in alternatives and _finite(value) and _finite(alternatives[token]):
                worst = max(worst, abs(value - alternatives[token]))
    return worst


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _excerpt(gen: dict[str, Any]) -> str:
    text = gen.get("text") or ""
    if gen.get("tool_calls"):
        text += f" {gen['tool_calls']}"
    return text if len(text) <= 80 else text[:77] + "..."


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
