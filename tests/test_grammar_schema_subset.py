"""The JSON Schema subset /v1/server_info claims: each keyword is enforced (or, where we
say so, accepted without being enforced), checked case by case against jsonschema."""

from __future__ import annotations

import json

import jsonschema
import pytest
from grammar_fixtures import accepts, compile_spec

from serve_app.grammar import SUPPORTED_JSON_SCHEMA

# ------------------------------------------------------------ the JSON Schema subset we claim

_OBJ_COUNT = {"type": "object", "additionalProperties": {"type": "integer"}}
_ARRAY_BOUNDS = {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}
_STRING_BOUNDS = {"type": "string", "minLength": 2, "maxLength": 3}
_INT_BOUNDS = {"type": "integer", "minimum": -5, "maximum": 120}
_NUMBER_OPEN = {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}
_POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}

# fmt: off
# keyword -> (schema, instances it must admit, instances it must refuse)
SCHEMA_CASES: dict[str, tuple[object, list[object], list[object]]] = {
    "type": ({"type": ["integer", "null"]}, [3, None], ["3", 1.5, True]),
    "enum": ({"enum": ["red", "green", 7]}, ["red", 7], ["blue", 8]),
    "const": ({"const": "fixed"}, ["fixed"], ["fixe", "other"]),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]},
              [1, "ab"], ["abc", None]),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, [1, True], ["x", None]),
    "allOf": ({"allOf": [{"type": "integer", "minimum": 3}]}, [3, 40], [2]),
    "$ref": ({"$defs": {"d": {"type": "integer", "maximum": 9}}, "$ref": "#/$defs/d"}, [9], [10]),
    "$defs": ({"$defs": {"p": _POINT}, "type": "array", "items": {"$ref": "#/$defs/p"}},
              [[{"x": 1}]], [[{}], [{"x": "1"}]]),
    "definitions": ({"definitions": {"p": _POINT}, "$ref": "#/definitions/p"},
                    [{"x": 1}], [{"y": 1}]),
    "properties": ({"type": "object", "properties": {"a": {"type": "integer"}}},
                   [{"a": 1}, {}], [{"a": "x"}]),
    "required": ({**_AB, "required": ["b"]}, [{"b": 1}, {"a": 1, "b": 2}], [{"a": 1}, {}]),
    "additionalProperties": ({**_AB, "additionalProperties": {"type": "boolean"}},
                             [{"a": 1, "z": True}], [{"a": 1, "z": 1}]),
    "patternProperties": ({"type": "object", "additionalProperties": False,
                           "patternProperties": {"^x_[a-z]+$": {"type": "integer"}}},
                          [{"x_a": 1}], [{"y": 1}, {"x_a": "s"}]),
    "propertyNames": ({**_OBJ_COUNT, "propertyNames": {"pattern": "^[a-z]{1,3}$"}},
                      [{"ab": 1}], [{"ABCD": 1}]),
    "minProperties": ({**_OBJ_COUNT, "minProperties": 1}, [{"a": 1}], [{}]),
    "maxProperties": ({**_OBJ_COUNT, "maxProperties": 1}, [{"a": 1}, {}], [{"a": 1, "b": 2}]),
    "items": ({"type": "array", "items": {"type": "integer"}}, [[], [1, 2]], [["a"], [1.5]]),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
                     "items": False}, [["a", 1], ["a"]], [[1, "a"], ["a", 1, 2]]),
    "minItems": (_ARRAY_BOUNDS, [[1], [1, 2]], [[]]),
    "maxItems": (_ARRAY_BOUNDS, [[1, 2]], [[1, 2, 3]]),
    "minLength": (_STRING_BOUNDS, ["ab", "abc"], ["a", ""]),
    "maxLength": (_STRING_BOUNDS, ["abc"], ["abcd"]),
    "pattern": ({"type": "string", "pattern": "^[a-c]+-[0-9]{2}$"}, ["ab-12"], ["ad-12", "ab-1"]),
    "format": ({"type": "string", "format": "date"}, ["2024-01-31"], ["2024-13-01", "today"]),
    "minimum": (_INT_BOUNDS, [-5, 0], [-6, -100]),
    "maximum": (_INT_BOUNDS, [120], [121, 1000]),
    "exclusiveMinimum": (_NUMBER_OPEN, [0.5, 0.001], [0, -0.5]),
    "exclusiveMaximum": (_NUMBER_OPEN, [0.999], [1, 1.5]),
    "multipleOf": ({"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50},
                   [0, 10, 50], [7, 55]),
}
# format -> (a value it admits, a value it refuses)
FORMAT_CASES = {
    "date": ("2024-01-31", "2024-1-31"), "time": ("12:30:00Z", "25:00"),
    "date-time": ("2024-01-31T12:30:00Z", "2024-01-31"), "duration": ("P3D", "3 days"),
    "email": ("a@b.co", "not an email"), "hostname": ("example.com", "-bad-"),
    "ipv4": ("192.168.0.1", "1.2.3"), "ipv6": ("::1", "zz"),
    "uuid": ("123e4567-e89b-12d3-a456-426614174000", "123"), "uri": ("https://x.org/a", "x y"),
    "uri-reference": ("/a/b", " x"), "uri-template": ("/a/{b}", "{"),
    "json-pointer": ("/a/b", "a"), "relative-json-pointer": ("0/a", "/a"),
}
# Accepted in a schema but not enforced: each instance violates its schema and still passes.
NOT_ENFORCED_CASES = {
    "not": ({"type": "integer", "not": {"const": 3}}, 3),
    "if/then/else": ({"type": "integer", "if": {"minimum": 10}, "then": {"maximum": 20}}, 25),
    "allOf with several subschemas": ({"allOf": [{"type": "integer"}, {"maximum": 5}]}, 6),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1]),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, [1]),
    "dependentRequired": ({**_AB, "dependentRequired": {"a": ["b"]}}, {"a": 1}),
    "dependentSchemas": ({**_AB, "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}),
    "unlisted formats": ({"type": "string", "format": "byte"}, "!!"),
}
# fmt: on


def test_claims_have_cases():
    assert set(SCHEMA_CASES) == set(SUPPORTED_JSON_SCHEMA["keywords"])
    assert set(FORMAT_CASES) == set(SUPPORTED_JSON_SCHEMA["formats"])
    assert set(NOT_ENFORCED_CASES) == set(SUPPORTED_JSON_SCHEMA["not_enforced"])
    assert set(SUPPORTED_JSON_SCHEMA["notes"]) <= set(SCHEMA_CASES)


@pytest.mark.parametrize("keyword", list(SCHEMA_CASES))
def test_claimed_keyword_is_enforced(service, engine_cache, keyword):
    schema, good, bad = SCHEMA_CASES[keyword]
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    payload = compile_spec(service, "json_schema", json.dumps(schema))
    for instance in good:
        assert validator.is_valid(instance), instance  # the case itself is right
        assert accepts(engine_cache, payload, json.dumps(instance)), instance
    for instance in bad:
        assert not validator.is_valid(instance), instance
        assert not accepts(engine_cache, payload, json.dumps(instance)), instance


def test_claimed_formats_are_enforced(service, engine_cache):
    for name, (good, bad) in FORMAT_CASES.items():
        schema = {"type": "string", "format": name}
        payload = compile_spec(service, "json_schema", json.dumps(schema))
        assert accepts(engine_cache, payload, json.dumps(good)), name
        assert not accepts(engine_cache, payload, json.dumps(bad)), name


def test_not_enforced_keywords_compile_but_do_not_constrain(service, engine_cache):
    for name, (schema, violation) in NOT_ENFORCED_CASES.items():
        payload = compile_spec(service, "json_schema", json.dumps(schema))
        assert accepts(engine_cache, payload, json.dumps(violation)), name
