"""Schema complexity limits (depth, node count) checked before anything compiles, for every
grammar carrier: request fields, tool parameters, and the server's own output formats."""

from __future__ import annotations

import json

import pytest

from serve_app import errors
from serve_app.grammar.schema_limits import (
    SchemaLimitExceeded,
    SchemaLimits,
    check_choice_limits,
    measure_schema,
)
from serve_app.protocol import parse_request


def nested_objects(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for i in range(levels):
        schema = {"type": "object", "properties": {f"k{i}": schema}, "required": [f"k{i}"]}
    return schema


@pytest.mark.parametrize(
    ("document", "depth", "nodes"),
    [
        ({"type": "integer"}, 1, 2),
        (True, 0, 1),
        ({"type": "array", "items": {"type": "string"}}, 2, 4),
        ({"enum": [[1, [2]], {"a": None}]}, 4, 8),
        (nested_objects(3), 7, 3 * 5 + 2),
    ],
)
def test_depth_and_nodes_are_measured_on_the_document(document, depth, nodes):
    assert measure_schema(document) == (depth, nodes)


def test_each_limit_is_named_and_its_bound_inclusive():
    schema = nested_objects(10)  # depth 21, 52 nodes
    measure_schema(schema, SchemaLimits(max_depth=21, max_nodes=52))
    with pytest.raises(SchemaLimitExceeded) as deep:
        measure_schema(schema, SchemaLimits(max_depth=20, max_nodes=10_000))
    assert (deep.value.limit, deep.value.bound) == ("max_schema_depth", 20)
    with pytest.raises(SchemaLimitExceeded) as wide:
        measure_schema(schema, SchemaLimits(max_depth=100, max_nodes=51))
    assert (wide.value.limit, wide.value.bound) == ("max_schema_nodes", 51)
    with pytest.raises(SchemaLimitExceeded, match="nodes"):
        check_choice_limits(["a"] * 6, SchemaLimits(max_nodes=5))


def test_a_document_far_past_the_limits_is_refused_without_recursion_or_a_full_walk():
    deep: list = []
    for _ in range(200_000):  # Python's own recursion would overflow long before this
        deep = [deep]
    with pytest.raises(SchemaLimitExceeded) as caught:
        measure_schema(deep, SchemaLimits(max_depth=64))
    assert caught.value.value == 65  # stopped where it passed the bound
    wide = {"enum": list(range(1_000_000))}
    with pytest.raises(SchemaLimitExceeded) as caught:
        measure_schema(wide, SchemaLimits(max_nodes=100))
    assert caught.value.limit == "max_schema_nodes"


def _chat(**fields) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body).encode()


def _tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


DEEP = nested_objects(40)  # depth 81: under the body's nesting limit, over max_schema_depth
CARRIERS = {
    "response_format.json_schema.schema": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": DEEP}}
    },
    "structured_outputs.json": {"structured_outputs": {"json": json.dumps(DEEP)}},
    "tools.0.function.parameters": {"tools": [_tool(DEEP)], "tool_choice": "required"},
}


@pytest.mark.parametrize("param", list(CARRIERS))
def test_every_carrier_is_bounded_at_parse_time(param):
    with pytest.raises(errors.APIError) as caught:
        parse_request("chat", _chat(**CARRIERS[param]))
    error = caught.value
    assert (error.status, error.code, error.param) == (400, "request_limit_exceeded", param)
    assert "max_schema_depth (64)" in error.message and not error.should_retry


def test_too_many_choices_name_the_node_limit():
    body = _chat(structured_outputs={"choice": [f"c{i}" for i in range(5000)]})
    with pytest.raises(errors.APIError) as caught:
        parse_request("chat", body)
    assert caught.value.code == "request_limit_exceeded"
    assert "max_schema_nodes" in caught.value.message


def test_output_formats_past_the_limits_or_the_subset_fail_at_startup(model_dirs):
    from pydantic import ValidationError

    from serve_app.config.options import ServeConfig

    model = str(model_dirs("llama"))
    deep = {"type": "object", "properties": {"a": nested_objects(40)}}
    with pytest.raises(ValidationError, match=r"output_formats\.deep: .*grammar\.max_schema_depth"):
        ServeConfig(model=model, generations={"output_formats": {"deep": deep}})
    remote = {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}
    with pytest.raises(ValidationError, match=r"output_formats\.remote: .*not a local reference"):
        ServeConfig(model=model, generations={"output_formats": {"remote": remote}})
    roomy = ServeConfig(
        model=model,
        grammar={"max_schema_depth": 128},
        generations={"output_formats": {"deep": deep}},
    )
    assert roomy.grammar.max_schema_depth == 128
