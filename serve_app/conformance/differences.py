"""A diff's vocabulary: the three classes, one difference, the report that holds them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


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
