"""Grammar admission over HTTP on the session's server: the compile-starvation attack (four
~24 KB schemas nested 360 deep, at once) is refused before anything compiles, schemas past the
complexity limits get 400 request_limit_exceeded naming the limit, a remote $ref is refused
naming the ref, and a fresh trivial schema is still served at once afterwards."""

from __future__ import annotations

import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

pytestmark = [pytest.mark.serve, pytest.mark.ray]


def nested_objects(levels: int, pad: int = 0) -> dict:
    schema: dict = {"type": "integer"}
    for i in range(levels):
        name = f"k{i}" + "x" * pad
        schema = {"type": "object", "properties": {name: schema}, "required": [name]}
    return schema


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def post_chat(serve_url: str, model_id: str, **fields) -> httpx.Response:
    body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24}
    return httpx.post(f"{serve_url}/v1/chat/completions", json={**body, **fields}, timeout=60)


def assert_client_fault(
    r: httpx.Response, code: str | set[str], param: str | set[str | None] | None
) -> dict:
    error = r.json()["error"]
    codes = {code} if isinstance(code, str) else code
    params = param if isinstance(param, set) else {param}
    assert r.status_code == 400 and error["code"] in codes, r.text
    assert error["param"] in params and r.headers["x-should-retry"] == "false", r.text
    return error


def test_attack_is_refused_and_a_fresh_trivial_schema_is_served_at_once(serve_url, model_id):
    # Warm-up: the compile workers start with the server, in the background; the bound below
    # is on a compile after the attack, not on their start.
    warm = schema_format({"type": "object", "properties": {"w": {"type": "boolean"}}})
    assert post_chat(serve_url, model_id, response_format=warm, max_tokens=4).status_code == 200
    attack = nested_objects(360)
    assert 20_000 < len(json.dumps(attack)) < 64 * 1024  # under the grammar size limit
    carriers = [
        ({"response_format": schema_format(attack)}, "response_format.json_schema.schema"),
        ({"structured_outputs": {"json": json.dumps(attack)}}, "structured_outputs.json"),
    ] * 2
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda c: post_chat(serve_url, model_id, **c[0]), carriers))
    for r, (_, param) in zip(answers, carriers, strict=True):
        # The body's own nesting limit may see it first (invalid_request), else the schema's.
        codes = {"invalid_request", "request_limit_exceeded"}
        error = assert_client_fault(r, codes, {None, param})
        assert "max_json_depth" in error["message"] or "max_schema_depth" in error["message"]
    fresh = {
        "type": "object",
        "properties": {f"f{uuid.uuid4().hex[:8]}": {"type": "integer", "maximum": 9}},
        "required": [],
    }
    started = time.monotonic()
    r = post_chat(serve_url, model_id, response_format=schema_format(fresh), max_tokens=12)
    elapsed = time.monotonic() - started
    assert r.status_code == 200, r.text
    # Served with the pool free: well under the 10 s compile timeout a clogged pool would
    # have made it wait (a loaded machine's request may take a second or two by itself).
    assert elapsed < 5.0, elapsed
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert set(json.loads(choice["message"]["content"])) <= set(fresh["properties"])


def test_limits_name_themselves_and_are_listed(serve_url, model_id, client):
    info = httpx.get(f"{serve_url}/v1/server_info").json()
    limits = info["limits"]
    depth, nodes = limits["max_schema_depth"], limits["max_schema_nodes"]
    assert (depth, nodes) == (64, 4096)
    too_deep = nested_objects(40)  # depth 81: within the body's nesting limit
    r = post_chat(serve_url, model_id, response_format=schema_format(too_deep))
    error = assert_client_fault(r, "request_limit_exceeded", "response_format.json_schema.schema")
    assert f"max_schema_depth ({depth})" in error["message"]
    too_wide = {"type": "string", "enum": [f"v{i}" for i in range(nodes)]}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=model_id,
            messages=[{"role": "user", "content": "hi"}],
            response_format=schema_format(too_wide),
        )
    assert caught.value.code == "request_limit_exceeded"
    assert f"max_schema_nodes ({nodes})" in caught.value.message
    tool = {"type": "function", "function": {"name": "f", "parameters": too_deep}}
    r = post_chat(serve_url, model_id, tools=[tool], tool_choice="required")
    assert_client_fault(r, "request_limit_exceeded", "tools.0.function.parameters")


REMOTE = "https://schemas.example.com/person.json"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": schema_format({"$ref": REMOTE})},
         "response_format.json_schema.schema"),
        (
            {"structured_outputs": {"json": json.dumps({"properties": {"p": {"$ref": REMOTE}}})}},
            "structured_outputs.json",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                    "type": "object", "properties": {"p": {"$ref": REMOTE}}}}}],
                "tool_choice": "required",
            },
            "tools.0.function.parameters",
        ),
    ],
)  # fmt: skip
def test_a_remote_ref_is_refused_naming_the_ref(serve_url, model_id, fields, param):
    r = post_chat(serve_url, model_id, **fields)
    error = assert_client_fault(r, "invalid_grammar", param)
    assert REMOTE in error["message"] and "not a local reference" in error["message"]


def test_server_info_states_the_refs_rule(serve_url):
    info = httpx.get(f"{serve_url}/v1/server_info").json()
    subset = info["grammar_backend"]["supported_json_schema"]
    assert "only local references" in subset["refs"]
    assert "non-local $ref" in subset["refused"] and "not_enforced" not in subset
    assert info["structured_output"]["compile_pool"]["saturated"].startswith("503 overloaded")
