"""A diff as tables: Markdown for people, JSON for tools."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from serve_app.conformance.differences import Classification, DiffReport

SHORT = {
    Classification.INTENDED: "intended",
    Classification.NUMERICAL: "numerical",
    Classification.REGRESSION: "**regression**",
}


def write_report(report: DiffReport, out: str | Path) -> tuple[Path, Path]:
    """REPORT.md and REPORT.json beside each other (`out` with or without a suffix)."""
    out = Path(out)
    base = out.with_suffix("") if out.suffix in (".md", ".json") else out
    md, js = base.with_name(base.name + ".md"), base.with_name(base.name + ".json")
    md.write_text(markdown(report))
    js.write_text(json.dumps(report.as_dict(), indent=1, ensure_ascii=False, default=str) + "\n")
    return md, js


def markdown(report: DiffReport) -> str:
    lines = ["# Conformance diff", "", report.summary_line() + ".", ""]
    lines += _servers(report) + [""]
    lines += _identity(report)
    lines += ["## Differences", ""]
    if report.differences:
        lines += [
            "| case | where | kind | old | new | class | why |",
            "|---|---|---|---|---|---|---|",
        ]
        for d in report.differences:
            where = d.path + (f" `{d.subject}`" if d.subject and d.kind.startswith("field") else "")
            lines.append(
                f"| {d.case} | {_cell(where)} | {d.kind} | {_cell(d.old)} | {_cell(d.new)} | "
                f"{SHORT[d.classification]} | {_cell(d.reason, 140)} |"
            )
    else:
        lines.append("None: every case observed the same thing.")
    lines.append("")
    if report.violations_in_both:
        lines += ["## Violations in both records (not differences)", ""]
        for case_id, violations in report.violations_in_both.items():
            lines.append(f"- {case_id}: {_cell('; '.join(violations))}")
        lines.append("")
    if report.declared_not_seen:
        lines += ["## Declared changes not seen in this diff", ""]
        lines += [f"- {c['kind']}: {c['description']}" for c in report.declared_not_seen] + [""]
    if report.notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in report.notes] + [""]
    lines += _timings(report)
    return "\n".join(lines) + "\n"


def _servers(report: DiffReport) -> list[str]:
    lines = ["| | old | new |", "|---|---|---|"]
    rows = [
        ("server", lambda s: s["server"].get("base_url")),
        ("model", lambda s: s["server"].get("model")),
        ("fingerprint", lambda s: (s["server"].get("observed") or {}).get("fingerprint")),
        ("run at", lambda s: s.get("started_at")),
        ("cases", lambda s: ", ".join(f"{n} {v}" for v, n in s["counts"].items())),
    ]
    for name, get in rows:
        lines.append(f"| {name} | {_cell(get(report.old))} | {_cell(get(report.new))} |")
    return lines


def _identity(report: DiffReport) -> list[str]:
    changed = [d for d in report.differences if d.kind == "identity"]
    if not changed:
        return ["Served identity: the same in both records.", ""]
    lines = ["Served identity changed (it explains differences in text, token ids and logprobs "
             "only):", ""]  # fmt: skip
    lines += [f"- `{d.subject}`: {_cell(d.old)} → {_cell(d.new)}" for d in changed]
    return lines + [""]


def _timings(report: DiffReport) -> list[str]:
    totals = [t for t in report.timings if t.name == "total_s"]
    if not totals:
        return []
    lines = ["## Timings (reported, never classified)", ""]
    lines += ["| case | old s | new s | new / old |", "|---|---|---|---|"]
    for t in totals:
        ratio = f"{t.new / t.old:.2f}" if t.old and t.new is not None else ""
        lines.append(f"| {t.case} | {_num(t.old)} | {_num(t.new)} | {ratio} |")
    return lines + [""]


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _cell(value: Any, limit: int = 90) -> str:
    if value is None:
        return ""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    text = text.replace("|", "\\|").replace("\n", "\\n")
    return text if len(text) <= limit else text[: limit - 1] + "…"
