"""Two generations of one case: where their tokens part ways, and whether numerics explain it.

Allowed numerical variation: the same tokens with logprobs within `LOGPROB_TOLERANCE`; greedy
outputs that part ways only after a near-tie: at the first differing token one run took the
other's runner-up, the two less than `NEAR_TIE_NATS` apart.
"""

from __future__ import annotations

import math
from typing import Any

from serve_app.conformance.differences import Classification, Difference

LOGPROB_TOLERANCE = 1e-4
NEAR_TIE_NATS = 0.05


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
