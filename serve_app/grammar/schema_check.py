"""The one check every grammar carrier runs before anything converts or compiles a schema
(`response_format`, `structured_outputs`, tool parameters): its complexity within the server's
limits (400 `request_limit_exceeded` naming the limit), then the subset enforced exactly (400
`invalid_grammar` naming what would not be enforced, such as a remote `$ref`)."""

from __future__ import annotations

from typing import Any

from serve_app import errors
from serve_app.grammar.schema_limits import (
    SchemaLimitExceeded,
    SchemaLimits,
    check_choice_limits,
    check_schema_limits,
    schema_limits,
)
from serve_app.grammar.schema_subset import SchemaRefused, check_schema_subset


def check_schema_carrier(schema: Any, param: str, limits: SchemaLimits | None = None) -> None:
    try:
        check_schema_limits(schema, limits or schema_limits())
        check_schema_subset(schema)
    except SchemaLimitExceeded as exc:
        raise limit_error(exc, param) from None
    except SchemaRefused as exc:
        raise errors.invalid_grammar(exc.reason, param) from None


def check_choices_carrier(
    choices: list[Any], param: str, limits: SchemaLimits | None = None
) -> None:
    try:
        check_choice_limits(choices, limits or schema_limits())
    except SchemaLimitExceeded as exc:
        raise limit_error(exc, param, hint="offer fewer choices") from None


def limit_error(
    exc: SchemaLimitExceeded,
    param: str,
    hint: str = "simplify the schema (use $defs and $ref for repeated parts)",
) -> errors.APIError:
    """As `errors.request_limit_exceeded`, saying what the number measures."""
    what = "nesting depth" if exc.limit == "max_schema_depth" else "node count"
    message = f"The {what} of '{param}' exceeds the limit {exc.limit} ({exc.bound}); {hint}."
    return errors.APIError(400, "request_limit_exceeded", message, param=param)
