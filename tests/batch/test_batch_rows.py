"""A batch row's own fields: `response_format` shapes and how `max_tokens` is capped."""

from __future__ import annotations

import json

import pytest

from serve_app.batch.rows import BatchDefaults, RowError, grammar_spec, sampling_params

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
OPENAI_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}


@pytest.mark.parametrize(
    ("raw", "kind"),
    [
        (None, None),
        (json.dumps({"type": "text"}), None),
        (json.dumps({"type": "json_object"}), "json_object"),
        (json.dumps(OPENAI_FORMAT), "json_schema"),
        (json.dumps({"json_schema": SCHEMA}), "json_schema"),
        (json.dumps({"regex": "[a-z]+"}), "regex"),
        (json.dumps({"choice": ["b", "a", "b"]}), "choice"),
        (json.dumps({"grammar": 'root ::= "x"'}), "ebnf"),
    ],
)
def test_response_format_shapes(raw, kind):
    spec = grammar_spec(raw)
    assert (spec.kind if spec else None) == kind
    if kind == "choice":
        assert spec.spec == '["a","b"]'


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        ("{oops", "invalid_request"),
        (json.dumps({"regex": "a", "choice": ["a"]}), "invalid_request"),
        (json.dumps({"type": "json_schema"}), "invalid_request"),
        (json.dumps({"choice": []}), "invalid_grammar"),
    ],
)
def test_bad_response_formats(raw, code):
    with pytest.raises(RowError) as info:
        grammar_spec(raw)
    assert info.value.code == code


def test_default_max_tokens_is_capped_by_the_context_but_a_row_value_is_not():
    defaults = BatchDefaults(max_tokens=100)
    assert sampling_params({}, defaults, 90, 128).max_tokens == 38
    assert sampling_params({"max_tokens": 20.0}, defaults, 90, 128).max_tokens == 20
    with pytest.raises(RowError) as info:
        sampling_params({"max_tokens": 50}, defaults, 90, 128)
    assert info.value.code == "max_tokens_exceeded"
    params = sampling_params({"temperature": float("nan"), "stop": "x"}, defaults, 1, 128)
    assert params.temperature == 1.0 and params.stop == ("x",)
