"""Canonical specs -> the EBNF xgrammar compiles, in the compile workers (imports xgrammar).

Only the grammar deployment's compile processes import this module: xgrammar imports torch,
and the ingress, which builds every `GrammarSpec`, must not. Each kind converts the same way
wherever it appears, alone or nested (tool-call arguments, a constraint after the reasoning
span): JSON schemas with no free whitespace (a weak model could otherwise pad until
max_tokens), strict unless `json_object`, and one JSON-string character patch.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Any

import xgrammar as xgr
from xgrammar.structural_tag import (
    AnyTextFormat,
    ConstStringFormat,
    GrammarFormat,
    OptionalFormat,
    SequenceFormat,
    StructuralTag,
    TagFormat,
    TagsWithSeparatorFormat,
)

from serve_app.grammar.spec import GrammarError, GrammarSpec, clean_reason
from serve_app.grammar.tools import (
    ARGUMENTS_PREFIX,
    CALL_PREFIX,
    CALL_SEPARATOR,
    CALL_SUFFIX,
    arguments_schema,
)
from serve_app.parsers.reasoning import THINK_CLOSE, THINK_OPEN

# NOTE: xgrammar 0.2.9's JSON-string character classes admit what JSON and UTF-8 forbid: raw
# control characters in length-bounded strings, and in every string the UTF-8 form of a
# surrogate (ED A0..BF xx), which detokenizes as three U+FFFD (a 24-character bound came back
# 26 characters long). Its printed EBNF is patched: each negated class that starts with the
# quote and backslash (`[^"\\...]`, after `\0-\x1f` or not) excludes both.
JSON_CHAR_CLASS = re.compile(r"\[\^(?:\\0-\\x1f)?(\\\"\\\\(?:\\.|[^\]\\])*)\]")
# What the chat template writes between `</think>` and the answer.
AFTER_REASONING = "\n\n"
OBJECT_SCHEMA = '{"type":"object"}'


def spec_ebnf(kind: str, canonical: str) -> str:
    """The EBNF of a canonical spec of any kind. Raises GrammarError when it does not convert
    (xgrammar's message, cleaned)."""
    try:
        return _ebnf(kind, canonical)
    except GrammarError:
        raise
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:  # what xgrammar raises
        raise GrammarError(clean_reason(exc)) from None


def _ebnf(kind: str, canonical: str) -> str:
    if kind in ("json_schema", "json_object"):
        schema = canonical if kind == "json_schema" else OBJECT_SCHEMA
        return _schema_ebnf(schema, kind == "json_schema")
    if kind == "regex":
        return str(xgr.Grammar.from_regex(canonical))
    if kind == "ebnf":
        return str(xgr.Grammar.from_ebnf(canonical))
    if kind == "choice":
        # JSON string escapes are valid EBNF string-literal escapes in xgrammar.
        choices = json.loads(canonical)
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    if kind == "tool_calls":
        return _tag_ebnf(tool_calls_tag(**json.loads(canonical)))
    if kind == "after_reasoning":
        return _tag_ebnf(after_reasoning_tag(**json.loads(canonical)))
    raise GrammarError(f"unsupported grammar kind {kind!r}")


@functools.lru_cache(maxsize=256)
def _schema_ebnf(canonical: str, strict: bool) -> str:
    # Requests repeat the same tools and schemas: one conversion each.
    grammar = xgr.Grammar.from_json_schema(canonical, any_whitespace=False, strict_mode=strict)
    return JSON_CHAR_CLASS.sub(_json_char_class, str(grammar))


def _json_char_class(match: re.Match[str]) -> str:
    return r"[^\0-\x1f" + match[1] + r"\uD800-\uDFFF]"


def _tag_ebnf(tag: StructuralTag) -> str:
    return str(xgr.Grammar.from_structural_tag(tag))


def arguments_ebnf(parameters: dict[str, Any] | None) -> str:
    """EBNF for a tool's arguments: always an object, valid against its `parameters`."""
    return _schema_ebnf(GrammarSpec.json_schema(arguments_schema(parameters)).spec, True)


def tool_calls_tag(
    functions: Sequence[tuple[str, dict[str, Any] | None]],
    only_one: bool,
    allow_reasoning: bool = False,
) -> StructuralTag:
    """One or more calls (exactly one with `only_one`) among (name, parameters) pairs, in the
    chat template's own form; `allow_reasoning`: an optional `<think>` block first."""
    tags = [
        TagFormat(
            begin=CALL_PREFIX + name + ARGUMENTS_PREFIX,
            content=GrammarFormat(grammar=arguments_ebnf(parameters)),
            end=CALL_SUFFIX,
        )
        for name, parameters in functions
    ]
    calls = TagsWithSeparatorFormat(
        tags=tags, separator=CALL_SEPARATOR, at_least_one=True, stop_after_first=only_one
    )
    if not allow_reasoning:
        return StructuralTag(format=calls)
    # Free text but a nested opening tag; the first `</think>` ends it, as the parser reads it.
    free = AnyTextFormat(excludes=[THINK_OPEN])
    think = TagFormat(begin=THINK_OPEN, content=free, end=THINK_CLOSE)
    block = SequenceFormat(elements=[think, ConstStringFormat(value=AFTER_REASONING)])
    return StructuralTag(format=SequenceFormat(elements=[OptionalFormat(content=block), calls]))


def after_reasoning_tag(
    inner: tuple[str, str], strict: bool, starts_in_reasoning: bool
) -> StructuralTag:
    """The `inner` (kind, canonical) constraint after a `<think>` block: optional, required
    (`strict`), or already open (`starts_in_reasoning`: the output begins inside it)."""
    answer = GrammarFormat(grammar=spec_ebnf(*inner))
    free = AnyTextFormat(excludes=[THINK_OPEN])
    begin = "" if starts_in_reasoning else THINK_OPEN
    block = SequenceFormat(
        elements=[
            TagFormat(begin=begin, content=free, end=THINK_CLOSE),
            ConstStringFormat(value=AFTER_REASONING),
        ]
    )
    head = block if strict or starts_in_reasoning else OptionalFormat(content=block)
    return StructuralTag(format=SequenceFormat(elements=[head, answer]))
