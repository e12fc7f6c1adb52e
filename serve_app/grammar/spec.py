"""The one output-constraint spec: `GrammarSpec`, canonical from the moment it is built.

Every carrier (`response_format`, `structured_outputs`, a generation profile's schema, a
batch row's `grammar` column, `tool_choice`, the reasoning wrapper) builds its constraint
here, once per request at admission; the grammar service compiles it and caches it by its
canonical text, and the engine enforces it. No other module canonicalises a spec.

Canonical text per kind: json_schema -> compact JSON with keyword order normalised (property
order and the key order inside enum/const values kept: they are the order of the generated
text); json_object -> "" (compiled as `{"type":"object"}`); choice -> a sorted, de-duplicated
JSON list; regex / ebnf -> the text as given; tool_calls -> {"functions": [[name, canonical
parameters or null], ...], "only_one", "allow_reasoning"}; after_reasoning -> {"inner": [kind,
text], "strict", "starts_in_reasoning"}. Light to import: no xgrammar (which imports torch),
so the ingress builds specs and only the grammar deployment converts and compiles them
(`serve_app.grammar.convert`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from serve_app.grammar.json_schema import canonical_schema, schema_json
from serve_app.grammar.schema_limits import SchemaLimitExceeded, SchemaLimits, measure_schema
from serve_app.grammar.schema_subset import SchemaRefused, check_schema_subset

GrammarKind = Literal[
    "json_schema", "json_object", "regex", "ebnf", "choice", "tool_calls", "after_reasoning"
]
# What clients may ask for (response_format, structured_outputs, a batch row's column).
GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "ebnf", "choice")
# What the server builds from other fields: `tool_choice` that forces calls, and any
# constraint moved after the reasoning span. Converted to EBNF in the compile workers.
STRUCTURAL_KINDS: tuple[str, ...] = ("tool_calls", "after_reasoning")
MAX_REASON_CHARS = 500
# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:NN: ".
_LOG_PREFIX = re.compile(r"\[\d{1,2}:\d{2}:\d{2}\]\s+\S+?:\d+:\s*")


class GrammarError(Exception):
    """A grammar the service will not compile; `code` is the API error code
    (`invalid_grammar`, `request_limit_exceeded`, `overloaded`, `grammar_unavailable`)."""

    def __init__(self, reason: str, code: str = "invalid_grammar"):
        super().__init__(reason)
        self.reason = reason
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray: keep both fields
        return (type(self), (self.reason, self.code))


def clean_reason(exc: BaseException | str) -> str:
    text = " ".join(_LOG_PREFIX.sub("", str(exc)).split())
    return text[:MAX_REASON_CHARS] or type(exc).__name__


@dataclass(frozen=True)
class GrammarSpec:
    """A canonical output constraint; equal constraints are equal specs (one cache key).

    `GrammarSpec(kind, text)` canonicalises a well-formed `text` on construction; the
    constructors below take a carrier's parsed value. Unpickling does not construct again: a
    spec crosses Ray as it was built.
    """

    kind: GrammarKind
    spec: str = ""

    def __post_init__(self) -> None:
        # A malformed text is kept as given: the grammar service refuses it, naming why.
        try:
            if self.kind == "json_schema" and self.spec:
                object.__setattr__(self, "spec", schema_json(_parse_schema(self.spec)))
            elif self.kind == "choice" and self.spec:
                object.__setattr__(self, "spec", _choices_json(_parse_choices(self.spec)))
        except GrammarError:
            pass

    @classmethod
    def _canonical(cls, kind: GrammarKind, text: str) -> GrammarSpec:
        """A spec whose text is canonical already (built from a parsed value): no second
        parse and dump in `__post_init__`."""
        spec = cls.__new__(cls)
        object.__setattr__(spec, "kind", kind)
        object.__setattr__(spec, "spec", text)
        return spec

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> GrammarSpec:
        return cls._canonical("json_schema", schema_json(schema))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object", "")

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        return cls._canonical("choice", _choices_json(choices))

    @classmethod
    def tool_calls(
        cls,
        functions: list[tuple[str, dict[str, Any] | None]],
        *,
        only_one: bool,
        allow_reasoning: bool = False,
    ) -> GrammarSpec:
        """One or more calls among (name, parameters) functions (exactly one: `only_one`),
        in the chat template's form; `allow_reasoning`: an optional `<think>` block first."""
        body = {
            "functions": [[name, _canonical_or_none(params)] for name, params in functions],
            "only_one": only_one,
            "allow_reasoning": allow_reasoning,
        }
        return cls("tool_calls", _compact(body))

    @classmethod
    def after_reasoning(
        cls, inner: GrammarSpec, *, strict: bool = False, starts_in_reasoning: bool = False
    ) -> GrammarSpec:
        """`inner` applied after a `<think>...</think>` block of free text and the template's
        `\\n\\n`: optional; required with `strict`; already open with `starts_in_reasoning`
        (the prompt ends inside it). The block admits any text but a nested `<think>`."""
        body = {
            "inner": [inner.kind, inner.spec],
            "strict": strict,
            "starts_in_reasoning": starts_in_reasoning,
        }
        return cls("after_reasoning", _compact(body))

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def ebnf(cls, grammar: str) -> GrammarSpec:
        return cls("ebnf", grammar)


def check_schema(schema: Any, limits: SchemaLimits | None = None) -> None:
    """Raise GrammarError unless `schema` is within `limits` (when given) and the subset
    enforced exactly: `request_limit_exceeded` / `invalid_grammar`."""
    try:
        if limits is not None:
            measure_schema(schema, limits)
        check_schema_subset(schema)
    except SchemaLimitExceeded as exc:
        reason = f"{exc}; the limit {exc.limit} allows {exc.bound}"
        raise GrammarError(reason, "request_limit_exceeded") from None
    except SchemaRefused as exc:
        raise GrammarError(exc.reason) from None
    except RecursionError:
        raise GrammarError("JSON schema nests too deeply") from None


def check_spec(spec: GrammarSpec, limits: SchemaLimits, *, nested: bool = False) -> None:
    """The service's check of a spec from any caller: a known kind, a non-empty text where
    the kind needs one, and every schema or choice list in it within `limits` and the subset."""
    kinds = GRAMMAR_KINDS + STRUCTURAL_KINDS
    if spec.kind not in kinds or (nested and spec.kind == "after_reasoning"):
        names = ", ".join(GRAMMAR_KINDS)
        raise GrammarError(f"unsupported grammar kind {spec.kind!r}; expected one of {names}")
    if spec.kind == "json_object":
        return
    if not isinstance(spec.spec, str) or not spec.spec:
        raise GrammarError(f"a {spec.kind} grammar needs a non-empty spec")
    if spec.kind == "json_schema":
        check_schema(_parse_schema(spec.spec), limits)
    elif spec.kind == "choice":
        count = len(_parse_choices(spec.spec))
        if count > limits.max_nodes:
            reason = f"{count} choices; the limit max_schema_nodes allows {limits.max_nodes}"
            raise GrammarError(reason, "request_limit_exceeded")
    elif spec.kind in STRUCTURAL_KINDS:
        _check_structural(spec, limits)


def _check_structural(spec: GrammarSpec, limits: SchemaLimits) -> None:
    try:
        body = json.loads(spec.spec)
        if spec.kind == "tool_calls":
            functions = body["functions"]
            if not functions or not all(isinstance(f[0], str) for f in functions):
                raise GrammarError("a tool_calls grammar needs named functions")
            for _, parameters in functions:
                if parameters is not None:
                    check_schema(parameters, limits)
        else:
            inner_kind, inner_text = body["inner"]
            check_spec(GrammarSpec(inner_kind, inner_text), limits, nested=True)
    except (ValueError, KeyError, TypeError, IndexError):
        raise GrammarError(f"malformed {spec.kind} spec") from None


def _canonical_or_none(schema: dict[str, Any] | None) -> Any:
    return None if schema is None else canonical_schema(schema)


def _compact(value: Any) -> str:
    # Key order as built (never sorted: property order is the order of the generated text).
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _parse_schema(text: str) -> dict[str, Any] | bool:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"JSON schema is not valid JSON: {exc}") from None
    except RecursionError:
        raise GrammarError("JSON schema nests too deeply") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError("a JSON schema must be an object or a boolean")
    return schema


def _parse_choices(text: str) -> list[str]:
    try:
        choices = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"choice spec is not valid JSON: {exc}") from None
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
        raise GrammarError("choice spec must be a non-empty JSON list of strings")
    return choices


def _choices_json(choices: list[str]) -> str:
    # Alternation order and duplicates do not change the language.
    return _compact(sorted(set(choices)))
