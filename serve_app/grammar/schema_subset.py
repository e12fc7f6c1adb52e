"""The JSON Schema subset enforced exactly: a schema outside it is refused, never widened.

xgrammar 0.2.9 compiles some schemas into a grammar that admits more than the schema does: it
warns and reads a remote `$ref` as "any JSON", drops `minLength`/`maxLength` beside `pattern`
or `format`, drops `multipleOf` on numbers, ignores regex anchors in the middle of a pattern;
and it silently ignores keywords it does not know (`not`, `uniqueItems`, `if`/`then`), keywords
of one type in a schema without `type`, `enum` values of another type than `type`, and every
assertion beside a `$ref`/`anyOf`/`oneOf`/`allOf`. Each case was found by compiling it and
checking the grammar against `jsonschema` (tests/grammar/test_grammar_schema_subset.py holds them).
`check_schema_subset` refuses all of them before anything compiles, so a tool's parameters
(converted in the ingress) get the same rule as a `response_format` schema; the compile worker
also refuses whatever xgrammar still warns about (`serve_app.grammar.compile_worker`).

Keywords JSON Schema does not define (`x-...`, `discriminator`, `nullable`) are annotations, as
the specification says, and are ignored; so are its own annotations (`title`, `description`...).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

# fmt: off
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "deprecated", "readOnly", "writeOnly",
    "$comment", "$schema", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$vocabulary",
    "contentEncoding", "contentMediaType", "contentSchema",
})
# JSON Schema keywords (2020-12, 2019-09, draft-07) that constrain and are not enforced.
NOT_ENFORCED = frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
    "contains", "minContains", "maxContains", "uniqueItems", "unevaluatedItems",
    "unevaluatedProperties", "additionalItems", "$dynamicRef", "$recursiveRef",
})
TYPE_KEYWORDS = {
    "string": frozenset({"minLength", "maxLength", "pattern", "format"}),
    "number": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                         "multipleOf"}),
    "array": frozenset({"items", "prefixItems", "minItems", "maxItems"}),
    "object": frozenset({"properties", "required", "additionalProperties", "patternProperties",
                         "propertyNames", "minProperties", "maxProperties"}),
}
FORMATS = frozenset({
    "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
    "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})
# fmt: on
# ---------------------------------------------------------------------- JSON Schema
# What /v1/server_info claims (xgrammar 0.2.9 with the service's options): tests/
# test_grammar_schema_subset.py holds an accept/reject case for every keyword listed and a
# refused case for every rule, so this cannot claim more than the check below enforces.
# fmt: off
SUPPORTED_JSON_SCHEMA: dict[str, Any] = {
    "types": ["object", "array", "string", "integer", "number", "boolean", "null"],
    "keywords": [
        "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
        "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
        "minProperties", "maxProperties", "items", "prefixItems", "minItems", "maxItems",
        "minLength", "maxLength", "pattern", "format",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    ],
    "notes": {
        "enum": "any JSON values, all of the schema's type; only type beside it",
        "const": "any JSON value of the schema's type; only type beside it",
        "oneOf": "branches must be provably disjoint (else refused)",
        "allOf": "a single subschema only",
        "$ref": "local only: '#' or '#/...' (a JSON pointer into this schema), recursion "
                "allowed; nothing beside it but annotations",
        "properties": "emitted in the declared order",
        "required": "names must also appear in properties",
        "additionalProperties": "false (the default here: strict mode), true or a schema",
        "patternProperties": "patterns match the whole property name; not beside properties",
        "minLength": "and maxLength: not with pattern or format; no escapes in such strings",
        "pattern": "matches the whole string, as if anchored; no lookaround, '^'/'$' only at "
                   "the ends",
        "multipleOf": "integers only, with both bounds or none",
    },
    "formats": sorted(FORMATS),
    "refs": "only local references ('#', '#/...'); remote, file, relative and anchor refs are "
            "refused with invalid_grammar naming the ref: nothing is ever fetched",
    # A constraint is enforced exactly or refused (400 invalid_grammar), never widened.
    "refused": sorted(NOT_ENFORCED) + [
        "allOf with several subschemas", "unlisted formats", "non-local $ref", "$id below the root",
        "assertions beside $ref/anyOf/oneOf/allOf", "type-specific keywords without type",
        "whatever xgrammar warns it would not enforce",
    ],
    "annotations": "title, description, default, examples, ... and keywords JSON Schema does "
                   "not define are ignored, as JSON Schema says",
    "output": "no whitespace beyond ', ' and ': ' separators; unlisted properties rejected",
}

# fmt: on

COMBINATORS = ("$ref", "anyOf", "oneOf", "allOf")
_ALL_TYPED = frozenset().union(*TYPE_KEYWORDS.values())
_DEFS = ("$defs", "definitions")
# Without `type`, these make xgrammar infer an object / array (narrower, never wider).
_INFERRED = frozenset({"properties", "required", "items"})
_NUMBER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


class SchemaRefused(ValueError):
    """`reason` says what would not be enforced, and where (a JSON pointer into the schema)."""

    def __init__(self, reason: str, pointer: str):
        where = pointer or "the root"
        super().__init__(f"{reason} (at {where})")
        self.reason = f"{reason} (at {where})"
        self.pointer = pointer


def check_schema_subset(schema: Any) -> None:
    """Raise SchemaRefused for the first part of `schema` the grammar would not enforce
    exactly. Walks without recursion; bound the schema's size first (schema_limits)."""
    for node, pointer in _subschemas(schema):
        if isinstance(node, dict):
            _check_node(node, pointer, is_root=pointer == "")
            _check_ref_target(schema, node, pointer)


def _subschemas(schema: Any) -> Iterator[tuple[Any, str]]:
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, pointer = stack.pop()
        yield node, pointer
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("propertyNames"), dict):
            # Property names are strings: the subschema's string keywords need no `type`.
            names = {"type": "string", **node["propertyNames"]}
            stack.append((names, f"{pointer}/propertyNames"))
        for key in ("items", "additionalProperties"):
            if key in node:
                stack.append((node[key], f"{pointer}/{key}"))
        for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            if isinstance(node.get(key), list):
                stack.extend((s, f"{pointer}/{key}/{i}") for i, s in enumerate(node[key]))
        for key in ("properties", "patternProperties", *_DEFS):
            if isinstance(node.get(key), dict):
                stack.extend((s, f"{pointer}/{key}/{_escape(n)}") for n, s in node[key].items())


def _check_node(node: dict[str, Any], pointer: str, *, is_root: bool) -> None:
    for keyword in node:
        if keyword in NOT_ENFORCED and not (keyword == "uniqueItems" and node[keyword] is False):
            raise SchemaRefused(f"'{keyword}' is not enforced by this server", pointer)
    if "$id" in node and not is_root:
        raise SchemaRefused(
            "'$id' is only supported at the root (it moves $ref resolution)", pointer
        )
    _check_ref(node, pointer)
    _check_combinators(node, pointer)
    _check_types(node, pointer)
    _check_values(node, pointer)
    _check_strings(node, pointer)
    _check_numbers(node, pointer)
    _check_objects(node, pointer)


def _check_ref(node: dict[str, Any], pointer: str) -> None:
    ref = node.get("$ref")
    if ref is None:
        return
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        shown = ref if isinstance(ref, str) else repr(ref)
        raise SchemaRefused(
            f"$ref {shown[:200]!r} is not a local reference: only '#' and '#/...' "
            "(JSON pointers into this schema) are supported, nothing is fetched",
            pointer,
        )


def _check_ref_target(root: Any, node: dict[str, Any], pointer: str) -> None:
    """A local `$ref` must name a part of this schema (a JSON pointer that resolves)."""
    ref = node.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return
    target = root
    for token in ref[2:].split("/"):
        name = unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and name in target:
            target = target[name]
        elif isinstance(target, list) and name.isdigit() and int(name) < len(target):
            target = target[int(name)]
        else:
            raise SchemaRefused(f"$ref {ref[:200]!r} does not resolve in this schema", pointer)


def _check_combinators(node: dict[str, Any], pointer: str) -> None:
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise SchemaRefused("'allOf' with more than one subschema is not enforced", pointer)
    present = [k for k in COMBINATORS if k in node]
    if not present:
        return
    if len(present) > 1:
        raise SchemaRefused(f"{' and '.join(present)} in one schema are not enforced", pointer)
    siblings = [k for k in node if _constrains(k) and k not in (*COMBINATORS, *_DEFS)]
    if siblings:
        raise SchemaRefused(
            f"'{siblings[0]}' beside '{present[0]}' is not enforced: move it into the "
            "referenced schema or into each branch",
            pointer,
        )


JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})


def _check_types(node: dict[str, Any], pointer: str) -> None:
    types = _types(node)
    unknown = sorted(types - JSON_TYPES) if types is not None else []
    if unknown or (types is not None and not types):
        # Refused here, where the request is checked: a schema xgrammar cannot convert must
        # not wait for the grammar deployment (tool parameters under `auto` never compile).
        name = unknown[0] if unknown else node.get("type")
        raise SchemaRefused(f"'type' {name!r:.60} is not a JSON Schema type", pointer)
    for keyword in node:
        if keyword not in _ALL_TYPED:
            continue
        owner = next(t for t, words in TYPE_KEYWORDS.items() if keyword in words)
        allowed = {owner, "integer"} if owner == "number" else {owner}
        if types is None and keyword in _INFERRED:
            continue
        if types is None:
            raise SchemaRefused(
                f"'{keyword}' needs 'type' ({owner}) in the same schema to be enforced", pointer
            )
        if not types & allowed:
            raise SchemaRefused(f"'{keyword}' does not apply to type {sorted(types)}", pointer)


def _check_values(node: dict[str, Any], pointer: str) -> None:
    for keyword in ("enum", "const"):
        if keyword not in node:
            continue
        others = [k for k in node if _constrains(k) and k not in (keyword, "type", *_DEFS)]
        if others:
            raise SchemaRefused(f"'{others[0]}' beside '{keyword}' is not enforced", pointer)
        types = _types(node)
        values = node[keyword] if keyword == "enum" else [node[keyword]]
        if types is not None and isinstance(values, list):
            for value in values:
                if not any(_is_type(value, t) for t in types):
                    raise SchemaRefused(
                        f"{keyword} value {value!r:.60} is not {sorted(types)}", pointer
                    )


def _check_strings(node: dict[str, Any], pointer: str) -> None:
    lengths = [k for k in ("minLength", "maxLength") if k in node]
    for keyword in ("pattern", "format"):
        if keyword in node and lengths:
            raise SchemaRefused(f"'{lengths[0]}' beside '{keyword}' is not enforced", pointer)
    fmt = node.get("format")
    if fmt is not None and not (isinstance(fmt, str) and fmt in FORMATS):
        raise SchemaRefused(f"format {str(fmt)[:60]!r} is not enforced", pointer)
    patterns = [node.get("pattern")]
    if isinstance(node.get("patternProperties"), dict):
        patterns += list(node["patternProperties"])
    for pattern in patterns:
        if isinstance(pattern, str):
            _check_pattern(pattern, pointer)


def _check_numbers(node: dict[str, Any], pointer: str) -> None:
    if "multipleOf" not in node:
        return
    if _types(node) != {"integer"}:
        raise SchemaRefused("'multipleOf' is enforced on type integer only", pointer)
    bounds = [k for k in _NUMBER_BOUNDS if k in node]
    has_low = any(k in node for k in ("minimum", "exclusiveMinimum"))
    has_high = any(k in node for k in ("maximum", "exclusiveMaximum"))
    if bounds and not (has_low and has_high):
        raise SchemaRefused("'multipleOf' with only one bound is not enforced", pointer)


def _check_objects(node: dict[str, Any], pointer: str) -> None:
    properties = node.get("properties")
    listed = set(properties) if isinstance(properties, dict) else set()
    required = node.get("required")
    for name in required if isinstance(required, list) else ():
        if not isinstance(name, str) or name not in listed:
            raise SchemaRefused(
                f"required property {str(name)[:60]!r} is not in 'properties'", pointer
            )
    if listed:
        for keyword in ("patternProperties", "propertyNames"):
            if keyword in node:
                raise SchemaRefused(f"'{keyword}' beside 'properties' is not enforced", pointer)


# A lookaround, or an anchor anywhere but first/last: xgrammar ignores them.
_LOOKAROUND = re.compile(r"\(\?<?[=!]")


def _check_pattern(pattern: str, pointer: str) -> None:
    body = _strip_classes_and_escapes(pattern)
    if _LOOKAROUND.search(body):
        raise SchemaRefused(f"pattern {pattern[:60]!r}: lookaround is not enforced", pointer)
    inner = body[1:] if body.startswith("^") else body
    inner = inner[:-1] if inner.endswith("$") else inner
    if "^" in inner or "$" in inner:
        raise SchemaRefused(
            f"pattern {pattern[:60]!r}: '^'/'$' only at the start/end are supported", pointer
        )


def _strip_classes_and_escapes(pattern: str) -> str:
    """The pattern with escapes and character classes blanked (their ^ and $ are literal)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            out.append("_")
            i += 2
            continue
        if in_class:
            in_class = char != "]" or out[-1] == "["
            out.append("_" if in_class else "]")
        elif char == "[":
            in_class = True
            out.append("[")
            if pattern[i + 1 : i + 2] == "^":
                out.append("_")
                i += 1
        else:
            out.append(char)
        i += 1
    return "".join(out)


def _constrains(keyword: str) -> bool:
    """Whether a keyword asserts something (annotations and unknown keywords do not)."""
    return keyword in _ALL_TYPED or keyword in NOT_ENFORCED or keyword in {
        "type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf", "$defs", "definitions",
    }  # fmt: skip


def _types(node: dict[str, Any]) -> set[str] | None:
    value = node.get("type")
    if value is None:
        return None
    if isinstance(value, str):
        return {value}
    # Not a type name or list of them: nothing matches (xgrammar refuses such a schema).
    return {t for t in value if isinstance(t, str)} if isinstance(value, list) else set()


def _is_type(value: Any, name: str) -> bool:
    if name == "integer":
        return _is_number(value) and float(value).is_integer()
    checks = {
        "number": _is_number,
        "string": lambda v: isinstance(v, str),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
    }
    check = checks.get(name)
    return check is not None and check(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")
