"""The prefix-cache scope: the server keys cached prompt blocks by tenant; only the operator's
`engine.shared_prefix_tenants` pools tenants, and no request field can name a namespace."""

from __future__ import annotations

import json

import pytest
import yaml

from serve_app import errors
from serve_app.access.keys import hash_key
from serve_app.access.prefix_scope import SHARED_NAMESPACE, prefix_namespace
from serve_app.config.options import ServeConfig
from serve_app.generations.protocol import GenerationCreate, parse_body
from serve_app.protocol import parse_request


@pytest.fixture
def checkpoint(tmp_path):
    """A folder ServeConfig accepts as a checkpoint (only config.json is checked)."""
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def keys_file(tmp_path, tenants: list[str]) -> str:
    entries = [{"id": f"key-{t}", "sha256": hash_key(f"sk-{t}"), "tenant": t} for t in tenants]
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": entries}))
    return str(path)


def test_each_tenant_has_its_own_namespace_unless_the_operator_pools_it() -> None:
    alone = [prefix_namespace(t, ()) for t in ("a", "b", "default")]
    assert len(set(alone)) == 3
    pooled = ("a", "b")
    assert prefix_namespace("a", pooled) == prefix_namespace("b", pooled) == SHARED_NAMESPACE
    assert prefix_namespace("c", pooled) == prefix_namespace("c", ())
    # No tenant name, however chosen, spells the pooled namespace.
    assert prefix_namespace(SHARED_NAMESPACE, pooled) != SHARED_NAMESPACE


def test_a_shared_tenant_that_no_key_has_fails_at_startup(checkpoint, tmp_path) -> None:
    keys = keys_file(tmp_path, ["alpha", "beta"])
    config = ServeConfig(
        model=checkpoint, api_keys_file=keys, engine={"shared_prefix_tenants": ["alpha", "beta"]}
    )
    assert config.engine.shared_prefix_tenants == ("alpha", "beta")
    with pytest.raises(ValueError, match=r"engine.shared_prefix_tenants: 'gamma'"):
        ServeConfig(
            model=checkpoint, api_keys_file=keys, engine={"shared_prefix_tenants": ["gamma"]}
        )
    # Without API keys every request is the one tenant "default".
    with pytest.raises(ValueError, match="shared_prefix_tenants"):
        ServeConfig(model=checkpoint, engine={"shared_prefix_tenants": ["alpha"]})
    with pytest.raises(ValueError, match="shared_prefix_tenants"):
        ServeConfig(model=checkpoint, engine={"shared_prefix_tenants": [""]})


BODIES = {
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "completion": {"model": "m", "prompt": "hi"},
    "generation": {"profile": "p", "input": "hi"},
}


def parse(kind: str, body: bytes):
    if kind == "generation":
        return parse_body(GenerationCreate, body)
    return parse_request(kind, body)


@pytest.mark.parametrize("kind", sorted(BODIES))
@pytest.mark.parametrize("field", ["cache_salt", "cache_namespace", "prefix_namespace"])
def test_a_client_cannot_name_the_cache_namespace(kind: str, field: str) -> None:
    body = {**BODIES[kind], field: "tenant:victim"}
    with pytest.raises(errors.APIError) as info:
        parse(kind, json.dumps(body).encode())
    assert info.value.status == 400
    assert (info.value.code, info.value.param) == ("unknown_parameter", field)
