"""Structured output over HTTP: schemas, regex, choice and json_object are enforced during
decode; grammars that do not compile are a 400 and the server keeps serving."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.serve

CHAT = [{"role": "user", "content": "Say something about JSON."}]


SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "enum": ["a", "b", "c"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "number", "minimum": -5, "maximum": 5},
                    "y": {"type": "number", "minimum": -5, "maximum": 5},
                },
                "required": ["x", "y"],
            },
            "ok": {"type": "boolean"},
        },
        "required": ["point"],
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "note": {"type": "string", "maxLength": 5},
        },
        "required": ["color"],
    },
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_outputs_validate(client, model_id, schema):
    for seed in (1, 2):
        r = client.chat.completions.create(
            model=model_id,
            messages=CHAT,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), schema)


def test_regex_choice_and_json_object(client, model_id):
    r = client.completions.create(
        model=model_id,
        prompt="id:",
        max_tokens=40,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{3}"}},
    )
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", r.choices[0].text)
    r = client.chat.completions.create(
        model=model_id,
        messages=CHAT,
        max_tokens=20,
        temperature=1.0,
        seed=4,
        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    )
    assert r.choices[0].message.content in {"yes", "no", "maybe"}
    r = client.chat.completions.create(
        model=model_id,
        messages=CHAT,
        max_tokens=300,
        temperature=0.7,
        seed=5,
        response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize(
    "extra",
    [
        {"structured_outputs": {"regex": "[unclosed"}},
        {"structured_outputs": {"grammar": "root ::= = bad"}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            }
        },
    ],
)
def test_invalid_grammar_is_400_and_server_keeps_serving(client, model_id, extra):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_id, messages=CHAT, max_tokens=5, extra_body=extra
        )
    assert info.value.body["code"] == "invalid_grammar"
    assert info.value.response.headers["x-should-retry"] == "false"
    ok = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")
