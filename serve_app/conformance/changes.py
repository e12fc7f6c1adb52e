"""The intended API changes file: what a release declares it changed on purpose.

```yaml
changes:
  - description: responses name their annotations   # required: why
    kind: field_added          # a difference kind (KINDS below)
    case: "*"                  # glob over case ids (default: any)
    path: "*"                  # glob over the difference's path in the record (default: any)
    field: "choices[].message.annotations"   # field_added / field_removed: the field's path
    key: chat_template_sha256  # identity: which identity fact
    old: ...                   # the value before (default: any)
    new: ...                   # the value after, e.g. a template's new hash (default: any)
    since: "2026-12-03"        # when (informational)
```

A difference is intended when one declared change matches all the selectors it gives.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# The project's own file, kept with the code it describes.
DEFAULT_CHANGES = Path(__file__).with_name("api_changes.yaml")

# What a difference can be (the diff's vocabulary, and what a change declares).
KINDS = (
    "identity",  # a served-identity fact: weights, tokenizer, template, grammar, parsers
    "case_added",
    "case_removed",
    "inputs",  # a case's request (the stop cases derive theirs from the model's output)
    "verdict",
    "status",
    "code",  # an error's code, type or param
    "header",
    "event_order",
    "field_added",
    "field_removed",
    "observation",  # a semantic fact a case checked (valid, equal, held, ...)
    "divergence",  # a generation's tokens part ways
    "text",
    "token_ids",
    "logprobs",
    "finish_reason",
    "token_count",  # usage
    "value",
)
SELECTORS = ("kind", "case", "path", "field", "key", "old", "new")
FIELDS = {*SELECTORS, "description", "since"}
_ANY = object()


class ChangesError(ValueError):
    pass


@dataclass(frozen=True)
class DeclaredChange:
    description: str
    kind: str
    case: str = "*"
    path: str = "*"
    subject: str = "*"  # `field` or `key`
    old: Any = _ANY
    new: Any = _ANY
    since: str | None = None

    def matches(self, kind: str, case: str, path: str, subject: str, old: Any, new: Any) -> bool:
        return (
            kind == self.kind
            and fnmatch.fnmatchcase(case, self.case)
            and fnmatch.fnmatchcase(path, self.path)
            and fnmatch.fnmatchcase(subject, self.subject)
            and (self.old is _ANY or self.old == old)
            and (self.new is _ANY or self.new == new)
        )

    def as_dict(self) -> dict[str, Any]:
        out = {"description": self.description, "kind": self.kind, "case": self.case}
        out.update(path=self.path, subject=self.subject, since=self.since)
        for name in ("old", "new"):
            if getattr(self, name) is not _ANY:
                out[name] = getattr(self, name)
        return out


def load_changes(path: str | Path | None = None) -> list[DeclaredChange]:
    """The declared changes of `path` (the project's file when None; none if it is absent)."""
    source = Path(path) if path is not None else DEFAULT_CHANGES
    if path is None and not source.is_file():
        return []
    try:
        data = yaml.safe_load(source.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ChangesError(f"{source}: not YAML: {exc}") from None
    entries = data.get("changes") if isinstance(data, dict) else None
    if entries is None:
        entries = [] if data == {} else None
    if not isinstance(entries, list):
        raise ChangesError(f"{source}: expected a mapping with a `changes` list")
    return [_entry(source, i, e, KINDS) for i, e in enumerate(entries)]


def _entry(source: Path, index: int, entry: Any, kinds: tuple[str, ...]) -> DeclaredChange:
    where = f"{source}: changes[{index}]"
    if not isinstance(entry, dict):
        raise ChangesError(f"{where}: expected a mapping")
    unknown = sorted(set(entry) - FIELDS)
    if unknown:
        raise ChangesError(f"{where}: unknown fields {unknown}; known: {sorted(FIELDS)}")
    if not entry.get("description"):
        raise ChangesError(f"{where}: `description` is required (say why)")
    if entry.get("kind") not in kinds:
        raise ChangesError(f"{where}: kind {entry.get('kind')!r} is not one of {list(kinds)}")
    if "field" in entry and "key" in entry:
        raise ChangesError(f"{where}: give `field` or `key`, not both")
    return DeclaredChange(
        description=str(entry["description"]),
        kind=entry["kind"],
        case=str(entry.get("case", "*")),
        path=str(entry.get("path", "*")),
        subject=str(entry.get("field", entry.get("key", "*"))),
        old=entry.get("old", _ANY),
        new=entry.get("new", _ANY),
        since=None if entry.get("since") is None else str(entry["since"]),
    )
