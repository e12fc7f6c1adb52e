"""The JSON Schema subset /v1/server_info claims: each keyword is enforced, checked case by
case against jsonschema; everything else the grammar would not enforce exactly is refused
(`invalid_grammar`), never widened: each refused case below was found by compiling it and
seeing xgrammar admit an instance jsonschema rejects (or warn that it would)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from serve_app.grammar.schema_subset import SchemaRefused, check_schema_subset
from serve_app.grammar.service import SUPPORTED_JSON_SCHEMA
from serve_app.grammar.spec import GrammarError
from tests.support.grammar import accepts, compile_spec

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
_P = {"a": {"type": "integer"}, "b": {"type": "integer"}}
_INT = {"type": "integer"}
# Each entry of SUPPORTED_JSON_SCHEMA["refused"] -> a schema it refuses.
REFUSED_CASES = {
    "not": {"type": "integer", "not": {"const": 3}},
    "if": {"type": "integer", "if": {"minimum": 10}, "then": {"maximum": 20}},
    "then": {"type": "integer", "then": {"maximum": 20}},
    "else": {"type": "integer", "else": {"maximum": 20}},
    "uniqueItems": {"type": "array", "items": _INT, "uniqueItems": True},
    "contains": {"type": "array", "items": _INT, "contains": {"const": 5}},
    "minContains": {"type": "array", "minContains": 2},
    "maxContains": {"type": "array", "maxContains": 2},
    "dependentRequired": {**_AB, "dependentRequired": {"a": ["b"]}},
    "dependentSchemas": {**_AB, "dependentSchemas": {"a": {"required": ["b"]}}},
    "dependencies": {**_AB, "dependencies": {"a": ["b"]}},
    "unevaluatedItems": {"type": "array", "unevaluatedItems": False},
    "unevaluatedProperties": {"type": "object", "unevaluatedProperties": False},
    "additionalItems": {"type": "array", "additionalItems": False},
    "$dynamicRef": {"$dynamicRef": "#meta"},
    "$recursiveRef": {"$recursiveRef": "#"},
    "allOf with several subschemas": {"allOf": [_INT, {"maximum": 5}]},
    "unlisted formats": {"type": "string", "format": "byte"},
    "non-local $ref": {"$ref": "https://example.com/schema.json"},
    "$id below the root": {"$defs": {"a": {"$id": "a.json", **_INT}}, "$ref": "#/$defs/a"},
    "assertions beside $ref/anyOf/oneOf/allOf": {"$defs": {"a": _INT}, "$ref": "#/$defs/a",
                                                 "maximum": 3},
    "type-specific keywords without type": {"minLength": 3},
    "whatever xgrammar warns it would not enforce": {"oneOf": [_INT, {"type": "number"}]},
}
# Found by experiment (xgrammar 0.2.9): the grammar admitted the instance, jsonschema does not.
WIDENED_CASES = {
    # Refs xgrammar warned about and read as "any JSON" (None: nothing resolves them offline).
    "remote ref": ({"$ref": "http://example.com/s.json"}, None),
    "file ref": ({"properties": {"a": {"$ref": "file:///etc/passwd"}}}, None),
    "relative ref": ({"$ref": "other.json#/a"}, None),
    "anchor ref": ({"$defs": {"a": {"$anchor": "x", **_INT}}, "$ref": "#x"}, None),
    "length beside pattern": ({"type": "string", "pattern": "[a-z]+", "maxLength": 3}, "abcd"),
    "length beside format": ({"type": "string", "format": "date", "maxLength": 3}, "2024-01-01"),
    "multipleOf on number": ({"type": "number", "multipleOf": 0.5}, 0.3),
    "multipleOf, one bound": ({"type": "integer", "multipleOf": 5, "minimum": 1}, 7),
    "anchor mid-pattern": ({"type": "string", "pattern": "a^b"}, "ab"),
    "lookahead": ({"type": "string", "pattern": "a(?=b)"}, "a"),
    "typeless maximum": ({"maximum": 3}, 5),
    "typeless minItems": ({"minItems": 2}, [1]),
    "type beside $ref": ({"$defs": {"a": {"minimum": 3}}, "type": "integer", "$ref": "#/$defs/a"},
                         2),
    "type beside anyOf": ({"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": 1}]}, 3),
    "required not listed": ({"type": "object", "properties": {"a": _INT}, "required": ["b"]},
                            {"a": 1}),
    "enum of another type": ({"type": "string", "enum": ["a", 1]}, 1),
    "const of another type": ({"type": "string", "const": 1}, 1),
    "bound beside enum": ({"type": "integer", "enum": [1, 5, 9], "maximum": 5}, 9),
    "pattern beside const": ({"type": "string", "const": "abc", "pattern": "^x"}, "abc"),
    "format beside enum": ({"type": "string", "format": "date", "enum": ["x"]}, "x"),
    "propertyNames beside properties": ({"type": "object", "properties": {"ABC": _INT},
                                         "propertyNames": {"maxLength": 2}}, {"ABC": 1}),
    "patternProperties beside properties": ({"type": "object", "properties": {"x_a": _INT},
                                             "patternProperties": {"^x_": {"minimum": 5}}},
                                            {"x_a": 1}),
}
# fmt: on


def test_claims_have_cases():
    assert set(SCHEMA_CASES) == set(SUPPORTED_JSON_SCHEMA["keywords"])
    assert set(FORMAT_CASES) == set(SUPPORTED_JSON_SCHEMA["formats"])
    assert set(REFUSED_CASES) == set(SUPPORTED_JSON_SCHEMA["refused"])
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


def test_claimed_keywords_pass_the_subset_check():
    for keyword, (schema, _, _) in SCHEMA_CASES.items():
        check_schema_subset(schema)  # raises if the claim and the check disagree
        assert keyword


@pytest.mark.parametrize("rule", list(REFUSED_CASES))
def test_each_refusal_rule_refuses_before_compiling(service, rule):
    with pytest.raises(GrammarError) as caught:
        compile_spec(service, "json_schema", json.dumps(REFUSED_CASES[rule]))
    assert caught.value.code == "invalid_grammar"


@pytest.mark.parametrize("case", list(WIDENED_CASES))
def test_a_schema_xgrammar_would_widen_is_refused(case):
    schema, instance = WIDENED_CASES[case]
    # The instance violates the schema: admitting it would be the widening.
    assert instance is None or not jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    ).is_valid(instance)
    with pytest.raises(SchemaRefused):
        check_schema_subset(schema)


def test_refusal_names_the_ref_and_where_it_is():
    schema = {"type": "object", "properties": {"a b/c": {"$ref": "https://evil.example/x"}}}
    with pytest.raises(SchemaRefused) as caught:
        check_schema_subset(schema)
    assert "'https://evil.example/x'" in caught.value.reason
    assert caught.value.pointer == "/properties/a b~1c"


def test_local_refs_and_annotations_are_accepted():
    pydantic_like = {
        "$defs": {"Pet": {"title": "Pet", "type": "object", "required": ["name"],
                          "properties": {"name": {"type": "string", "title": "Name"}}}},
        "type": "object", "title": "Owner", "x-vendor": True, "required": ["pet"],
        "properties": {"pet": {"$ref": "#/$defs/Pet", "description": "the pet"},
                       "nick": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
                       "next": {"$ref": "#"}},
    }  # fmt: skip
    check_schema_subset(pydantic_like)


def test_malformed_schemas_are_refused_or_passed_on_never_crash_the_check():
    """Any JSON document: the check answers SchemaRefused or lets xgrammar judge it; nothing
    else escapes (it would be a 500)."""
    import random

    rng = random.Random(0)
    keys = ["type", "enum", "const", "anyOf", "allOf", "$ref", "$defs", "properties", "required",
            "items", "patternProperties", "propertyNames", "format", "pattern", "minLength",
            "multipleOf", "minimum", "$id", "not", "x-vendor"]  # fmt: skip
    leaves = [None, True, 0, 1.5, "a", "integer", "#", "#/a", "^a$", [], {}]

    def document(depth: int) -> object:
        roll = rng.random()
        if depth > 4 or roll < 0.3:
            return rng.choice(leaves)
        if roll < 0.5:
            return [document(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice(keys): document(depth + 1) for _ in range(rng.randint(0, 4))}

    outcomes = set()
    for _ in range(3000):
        try:
            check_schema_subset(document(0))
            outcomes.add("passed")
        except SchemaRefused:
            outcomes.add("refused")
    assert outcomes == {"passed", "refused"}
