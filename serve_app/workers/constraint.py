"""A request's output constraint, started on the grammar deployment at admission: every
family that takes a chat-shaped request (tools, response formats, reasoning first) starts
its grammar here, before any header is sent."""

from __future__ import annotations

from typing import Any

from serve_app import errors
from serve_app.grammar.spec import GrammarSpec
from serve_app.parsers.chat_output import ParseOptions


async def start_grammar(
    req: Any,
    parse: ParseOptions | None,
    *,
    identity: dict[str, Any],
    options: Any,  # GrammarOptions
    compiler: Any,  # the grammar deployment's handle
) -> list[object] | None:
    spec = grammar_spec(req, parse, identity=identity, options=options)
    return None if spec is None else await compile_grammar(compiler, spec)


def grammar_spec(
    req: Any, parse: ParseOptions | None, *, identity: dict[str, Any], options: Any
) -> GrammarSpec | None:
    """The request's constraint, checked (400s name its field), or None without one."""
    spec = req.grammar_spec()
    if spec is None:
        return None
    param = req.grammar_param()
    if not identity.get("grammar", {}).get("available"):
        raise errors.unsupported_parameter(
            param or "response_format", "structured output is unavailable on this server"
        )
    # Tool grammars are generated from `tools`, which the body limit already bounds.
    if param != "tool_choice" and len(spec.spec.encode()) > options.max_spec_bytes:
        raise errors.invalid_request(
            f"grammar spec is larger than {options.max_spec_bytes} bytes", param
        )
    return after_reasoning(req, spec, parse, options)


async def compile_grammar(compiler: Any, spec: GrammarSpec) -> list[object]:
    """Start the compile; the engine request's `grammar`. Boxed so the engine call does not
    wait for it: prefill overlaps compilation. The calling process owns the result: work
    handed to another process compiles there (a result whose owner died is lost)."""
    ref = await compiler.compile.remote(spec)._to_object_ref()
    return [ref]


def after_reasoning(
    req: Any, spec: GrammarSpec, parse: ParseOptions | None, options: Any
) -> GrammarSpec:
    """The constraint, moved after the reasoning span when the request lets the model
    think first (or the prompt already opened the span); strict: the span is required."""
    strict = bool(getattr(req, "strict_thinking", False))
    if strict and not getattr(options, "strict_thinking", False):
        raise errors.unsupported_parameter(
            "strict_thinking", "this server was not started with grammar.strict_thinking"
        )
    opens = parse is not None and parse.starts_in_reasoning
    if not (strict or opens or (parse is not None and parse.reasoning and req.thinking)):
        return spec
    return GrammarSpec.after_reasoning(spec, strict=strict, starts_in_reasoning=opens)
