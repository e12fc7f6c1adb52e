"""Canonical JSON schemas: keyword order normalised so equal schemas share a compile-cache
key, while the order of `properties` (the order of the generated object's keys) and the
key order inside enum/const values are kept."""

from __future__ import annotations

import json
from typing import Any

# fmt: off
# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SUBSCHEMA = frozenset({
    "items", "additionalProperties", "propertyNames", "contains", "not", "if", "then", "else",
    "unevaluatedProperties", "unevaluatedItems", "additionalItems",
})
# fmt: on
_SUBSCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_SUBSCHEMA_MAPS = frozenset({"$defs", "definitions", "patternProperties", "dependentSchemas"})


def schema_json(schema: Any) -> str:
    """A schema as compact canonical JSON text."""
    return json.dumps(canonical_schema(schema), ensure_ascii=False, separators=(",", ":"))


def canonical_schema(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for name in sorted(node):
        value = node[name]
        if name == "properties" and isinstance(value, dict):
            out[name] = {prop: canonical_schema(sub) for prop, sub in value.items()}
        elif name in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[name] = {prop: canonical_schema(value[prop]) for prop in sorted(value)}
        elif name in _SUBSCHEMA_LISTS and isinstance(value, list):
            out[name] = [canonical_schema(sub) for sub in value]
        elif name in _SUBSCHEMA:
            out[name] = canonical_schema(value)
        else:
            out[name] = value
    return out
