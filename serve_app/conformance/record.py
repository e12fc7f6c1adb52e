"""A run's record: who was tested and what each case observed, as one JSON document.

```
{"suite": {"version", "cases"}, "server": {"base_url", "model", "identity", "observed"},
 "started_at", "duration_s",
 "cases": [{"id", "title", "verdict", "violations", "observation", "inputs", "outputs",
            "timings", "server_answer", "notes"}]}
```

`observation` holds the semantic facts a case checked; `outputs` what the server answered, in
the shapes `observe` builds (its key names tell the diff what kind of fact each value is);
`notes` and `timings` are reported, never compared.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, NoReturn

# Bumped when a case's inputs or the record's layout change: two records of different
# versions are not compared case by case.
SUITE_VERSION = 1


class Verdict(StrEnum):
    PASS = "pass"
    VIOLATION = "violation"
    UNSUPPORTED = "unsupported"


class Unsupported(Exception):
    """Raised by a case the server does not support; `answer` is the server's own."""

    def __init__(self, reason: str, answer: Any = None):
        super().__init__(reason)
        self.reason = reason
        self.answer = answer


class Failed(Exception):
    """Raised by a case that cannot go on (the server refused or broke a step it needs)."""


@dataclass
class CaseRecord:
    """One case while it runs, then as recorded."""

    id: str
    title: str
    verdict: Verdict = Verdict.PASS
    violations: list[str] = field(default_factory=list)
    observation: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    server_answer: Any = None
    notes: dict[str, Any] = field(default_factory=dict)

    def check(self, ok: bool, message: str) -> bool:
        """Record a contract clause; a false one is a violation (the case goes on)."""
        if not ok:
            self.violations.append(message)
        return ok

    def unsupported(self, reason: str, answer: Any = None) -> NoReturn:
        raise Unsupported(reason, answer)

    def fail(self, message: str) -> NoReturn:
        raise Failed(message)

    def finish(self) -> None:
        if self.violations:
            self.verdict = Verdict.VIOLATION

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["verdict"] = str(self.verdict)
        return data


@dataclass
class Record:
    server: dict[str, Any]
    cases: list[dict[str, Any]]
    suite: dict[str, Any] = field(default_factory=dict)
    started_at: str = ""
    duration_s: float = 0.0

    def case(self, case_id: str) -> dict[str, Any] | None:
        return next((c for c in self.cases if c["id"] == case_id), None)

    def counts(self) -> dict[str, int]:
        out = {str(v): 0 for v in Verdict}
        for c in self.cases:
            out[c["verdict"]] += 1
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "suite": self.suite,
            "server": self.server,
            "started_at": self.started_at,
            "duration_s": self.duration_s,
            "counts": self.counts(),
            "cases": self.cases,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=1, ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Record:
        data = json.loads(Path(path).read_text())
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Record:
        for key in ("server", "cases"):
            if key not in data:
                raise ValueError(f"not a conformance record: no {key!r}")
        return cls(
            server=data["server"],
            cases=data["cases"],
            suite=data.get("suite", {}),
            started_at=data.get("started_at", ""),
            duration_s=data.get("duration_s", 0.0),
        )
