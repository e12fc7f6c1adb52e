"""Output constraints that apply after the reasoning span.

A constraint (a `response_format` schema, `structured_outputs`, or the grammar that enforces
`tool_choice`) normally holds from the first generated token. When a request lets the model
think (`chat_template_kwargs.enable_thinking: true`), the constraint is wrapped so that the
output may first open with a `<think>...</think>` block of free text, then `\\n\\n` (as the chat
template renders reasoning back), then the constrained answer. Inside the block the mask admits
any text but a nested `<think>`: the first `</think>` ends it, exactly as the reasoning parser
reads it. With strict thinking the block is mandatory: the model must reason, and the mask is
applied inside the reasoning span as well as after it. A prompt that already ends inside an open
`<think>` (templates that pre-fill the tag) starts the output in the block.

The wrapped result is an ordinary EBNF `GrammarSpec`, compiled and cached by the grammar
deployment like any other; every kind is first printed as the EBNF the service would build.
"""

from __future__ import annotations

import json

import xgrammar as xgr
from xgrammar.structural_tag import (
    AnyTextFormat,
    ConstStringFormat,
    GrammarFormat,
    OptionalFormat,
    SequenceFormat,
    StructuralTag,
    TagFormat,
)

from serve_app.grammar.compile_worker import BOUNDED_CHAR as _BOUNDED_CHAR
from serve_app.grammar.compile_worker import JSON_STRING_CHAR as _JSON_STRING_CHAR
from serve_app.grammar.spec import GrammarError, GrammarSpec, check_schema, clean_reason
from serve_app.parsers.reasoning import THINK_CLOSE, THINK_OPEN

# What the chat template writes between `</think>` and the answer.
AFTER_REASONING = "\n\n"


def constraint_ebnf(kind: str, spec: str) -> str:
    """A constraint (a canonical `GrammarSpec`'s kind and text) as the EBNF the grammar
    service compiles for it (same options, same JSON-string patch). Raises GrammarError when
    it does not convert."""
    try:
        if kind in ("json_schema", "json_object"):
            if kind == "json_schema":
                check_schema(json.loads(spec))
            schema = spec if kind == "json_schema" else '{"type":"object"}'
            strict = kind == "json_schema"
            grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
            return str(grammar).replace(_BOUNDED_CHAR, _JSON_STRING_CHAR)
        if kind == "regex":
            return str(xgr.Grammar.from_regex(spec))
        if kind == "choice":
            choices = json.loads(spec)
            return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        if kind == "ebnf":
            return str(xgr.Grammar.from_ebnf(spec))
    except GrammarError:
        raise
    except (RuntimeError, ValueError, TypeError) as exc:  # what xgrammar raises
        raise GrammarError(clean_reason(exc)) from None
    raise GrammarError(f"unsupported grammar kind {kind!r}")


def after_reasoning(
    spec: GrammarSpec, *, strict: bool = False, starts_in_reasoning: bool = False
) -> GrammarSpec:
    """`spec` applied after an optional reasoning block;
    `strict`: the block is required; `starts_in_reasoning`: the output begins inside it."""
    inner = GrammarFormat(grammar=constraint_ebnf(spec.kind, spec.spec))
    free = AnyTextFormat(excludes=[THINK_OPEN])
    begin = "" if starts_in_reasoning else THINK_OPEN
    block = SequenceFormat(
        elements=[
            TagFormat(begin=begin, content=free, end=THINK_CLOSE),
            ConstStringFormat(value=AFTER_REASONING),
        ]
    )
    required = strict or starts_in_reasoning
    head = block if required else OptionalFormat(content=block)
    try:
        grammar = xgr.Grammar.from_structural_tag(
            StructuralTag(format=SequenceFormat(elements=[head, inner]))
        )
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(clean_reason(exc)) from None
    return GrammarSpec("ebnf", str(grammar))
