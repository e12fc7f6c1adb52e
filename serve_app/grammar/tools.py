"""Grammars that enforce `tool_choice`, and the request checks for `tools`.

`tool_choice: required` and a named function compile to a grammar whose every complete output
is one or more calls in the chat template's own form,

    <tool_call>\\n{"name": "<tool>", "arguments": <object>}\\n</tool_call>

separated by one newline, the arguments valid against that tool's `parameters` schema.
`parallel_tool_calls: false` and a named function allow exactly one call. `auto` and `none`
need no grammar: under `auto` the tool parser validates what the model chose to emit.

Each tool's arguments grammar is what the grammar service builds for a `json_schema` spec (no
free whitespace, so a weak model cannot pad until max_tokens; strict: unlisted properties
rejected; the same string-character patch). The calls around them are an xgrammar structural
tag (`tags_with_separator`). This module only validates and builds the `tool_calls` spec; the
compile workers convert it (`serve_app.grammar.convert`), so the ingress never imports
xgrammar.

Names are limited to OpenAI's `[A-Za-z0-9_-]{1,64}`, so they splice into the grammar unescaped.
Missing `parameters` means no arguments (`{}`), as OpenAI defines it; `strict` is ignored:
arguments are always enforced.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from serve_app.errors import APIError

# The JSON-string patch lives with GrammarService; both must emit the same JSON strings.
from serve_app.grammar.schema_check import check_schema_carrier
from serve_app.grammar.schema_subset import COMBINATORS
from serve_app.grammar.spec import GrammarSpec

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CALL_PREFIX = '<tool_call>\n{"name": "'
ARGUMENTS_PREFIX = '", "arguments": '
CALL_SUFFIX = "}\n</tool_call>"
CALL_SEPARATOR = "\n"
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
TOOL_CHOICE_MODES = ("none", "auto", "required")


class ToolSpecError(ValueError):
    """A bad `tools` / `tool_choice` / `parallel_tool_calls` value; `param` names the field
    (dotted, as the API's error `param`), and the message starts with it."""

    def __init__(self, param: str, reason: str, code: str = "invalid_request") -> None:
        super().__init__(f"{param}: {reason}")
        self.param = param
        self.reason = reason
        # `invalid_grammar` when a parameter schema does not compile or would not be enforced
        # exactly, as for response_format; `request_limit_exceeded` past the schema limits.
        self.code = code


def validate_tools(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
) -> None:
    """Raise ToolSpecError for what the request cannot mean. `none` and `auto` without tools
    are accepted (nothing to call either way, as the parameter policy already treats them)."""
    names = _check_tools(tools) if tools is not None else []
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolSpecError("parallel_tool_calls", "must be a boolean")
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    forced = forced_tool_name(tool_choice)
    if not names:
        raise ToolSpecError("tool_choice", "needs a non-empty 'tools' list")
    if forced is not None and forced not in names:
        raise ToolSpecError("tool_choice.function.name", f"no tool named {forced!r} in 'tools'")


def forced_tool_name(tool_choice: str | Mapping[str, Any] | None) -> str | None:
    """The function a named `tool_choice` forces; None for the string modes."""
    if tool_choice is None or tool_choice in TOOL_CHOICE_MODES:
        return None
    shape = "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}"
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function":
        raise ToolSpecError("tool_choice", shape)
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise ToolSpecError("tool_choice.function.name", "must be a string")
    return name


def tool_names(tools: Sequence[Mapping[str, Any]] | None) -> list[str]:
    return [tool["function"]["name"] for tool in tools or ()]


def tool_call_grammar(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    parallel_tool_calls: bool | None = None,
    *,
    allow_reasoning: bool = False,
) -> GrammarSpec | None:
    """The grammar that enforces `tool_choice`, or None when it needs none. Validate first.

    `allow_reasoning` lets the output open with a `<think>...</think>` block of free text
    before the calls: the grammar then applies after the reasoning span (the template's
    `\\n\\n` follows `</think>`). Reasoning inside the block is not constrained."""
    if tool_choice is None or tool_choice in ("none", "auto") or not tools:
        return None
    forced = forced_tool_name(tool_choice)
    functions = [tool["function"] for tool in tools]
    if forced is not None:
        functions = [f for f in functions if f["name"] == forced]
    return GrammarSpec.tool_calls(
        [(f["name"], f.get("parameters")) for f in functions],
        only_one=forced is not None or parallel_tool_calls is False,
        allow_reasoning=allow_reasoning,
    )


def arguments_schema(parameters: Mapping[str, Any] | None) -> dict[str, Any]:
    """The schema the arguments must satisfy: always an object."""
    if parameters is None:
        return dict(NO_PARAMETERS)
    # `type` may be left out of an object schema; the arguments must still be an object.
    # Beside a `$ref` or a combinator it would not be enforced (schema_subset refuses it).
    if any(key in parameters for key in COMBINATORS):
        return dict(parameters)
    return {"type": "object", **parameters}


def _check_tools(tools: Any) -> list[str]:
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise ToolSpecError("tools", "must be a list")
    if not tools:
        raise ToolSpecError("tools", "must not be empty (leave it out instead)")
    names: list[str] = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise ToolSpecError(f"{where}.type", "only 'function' tools are supported")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise ToolSpecError(f"{where}.function", "must be an object")
        name = function.get("name")
        if not isinstance(name, str) or TOOL_NAME.fullmatch(name) is None:
            reason = "must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-'"
            raise ToolSpecError(f"{where}.function.name", reason)
        if name in names:
            raise ToolSpecError(f"{where}.function.name", f"{name!r} is defined twice")
        names.append(name)
        _check_parameters(function.get("parameters"), f"{where}.function.parameters")
    return names


def _check_parameters(parameters: Any, param: str) -> None:
    if parameters is None:
        return
    if not isinstance(parameters, Mapping):
        raise ToolSpecError(param, "must be a JSON Schema object")
    if parameters.get("type", "object") != "object":
        raise ToolSpecError(param, "must describe an object (type 'object')")
    # Bounded and exact before the grammar deployment converts it (xgrammar never runs in
    # the ingress: it imports torch).
    try:
        check_schema_carrier(arguments_schema(parameters), param)
    except APIError as exc:
        reason = exc.message.removeprefix("Invalid grammar: ")
        raise ToolSpecError(param, reason, exc.code) from None
