"""The error classes an open server cannot show, against a server with API keys (a second app
on the tiny llama): a wrong key is 401, a key's `max_concurrent_requests: 1` is 429."""

from __future__ import annotations

import pytest
import yaml

from serve_app.access.keys import hash_key
from serve_app.conformance.cases import select
from serve_app.conformance.runner import run_suite
from serve_app.conformance.session import Target
from tests.support.side_apps import deploy, side_config

pytestmark = [pytest.mark.serve, pytest.mark.ray]

KEYS = {
    "sk-conformance": {"id": "conformance", "tenant": "conformance"},
    "sk-conformance-one": {
        "id": "conformance-one",
        "tenant": "conformance",
        "limits": {"max_concurrent_requests": 1},
    },
}


@pytest.fixture(scope="module")
def keyed_url(serve_url, ray_session, model_dirs, tmp_path_factory):
    from ray import serve

    path = tmp_path_factory.mktemp("conformance-keys") / "keys.yaml"
    path.write_text(
        yaml.safe_dump({"keys": [{"sha256": hash_key(k), **e} for k, e in KEYS.items()]})
    )
    config = side_config(
        model_dirs("llama"),
        "conformance-keyed",
        tmp_path_factory.mktemp("conformance-keyed-data"),
        api_keys_file=str(path),
    )
    url = f"{serve_url}/conformance-keyed"
    try:
        # Not side_app(): its readiness wait reads the admin port, which needs an admin key here.
        deploy(config, "serve-app-conformance-keyed", url, "/conformance-keyed")
        yield url
    finally:
        serve.delete("serve-app-conformance-keyed")


def test_a_keyed_server_shows_401_and_429(keyed_url):
    target = Target(keyed_url, api_key="sk-conformance", limited_key="sk-conformance-one")
    cases = ["server-info", "error-auth", "error-concurrency-limit", "error-unknown-parameter"]
    record = run_suite(target, select(cases))
    verdicts = {c["id"]: (c["verdict"], c["violations"]) for c in record.cases}
    assert verdicts == {case: ("pass", []) for case in cases}
    limited = record.case("error-concurrency-limit")["outputs"]["error"]
    assert (limited["status"], limited["code"]) == (429, "concurrency_limit")
    assert limited["headers"]["retry-after"] == "seconds>=1"
