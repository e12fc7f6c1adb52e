"""The error classes an open server cannot show, against a server with API keys and the
fault-injection setting (a second app on the tiny llama): a wrong key is 401, a key limited to
other models 403, a key's `max_concurrent_requests: 1` 429, and an injected fault 500."""

from __future__ import annotations

import pytest
import yaml

from serve_app.access.keys import hash_key
from serve_app.conformance import revisions
from serve_app.conformance.cases import select
from serve_app.conformance.runner import run_suite
from serve_app.conformance.session import Target
from tests.support.side_apps import deploy, side_config

pytestmark = [pytest.mark.serve, pytest.mark.ray]

# The keys `make conformance-diff` serves with: the suite's, a limited and a restricted one.
KEYS = revisions.KEYS


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
        fault_injection=True,
    )
    url = f"{serve_url}/conformance-keyed"
    try:
        # Not side_app(): its readiness wait reads the admin port, which needs an admin key here.
        deploy(config, "serve-app-conformance-keyed", url, "/conformance-keyed")
        yield url
    finally:
        serve.delete("serve-app-conformance-keyed")


def test_a_keyed_server_shows_401_403_429_and_500(keyed_url):
    target = Target(
        keyed_url,
        api_key="sk-conformance",
        limited_key="sk-conformance-one",
        restricted_key="sk-conformance-other-model",
    )
    cases = [
        "server-info",
        "error-auth",
        "error-model-not-permitted",
        "error-concurrency-limit",
        "error-internal",
        "error-unknown-parameter",
    ]
    record = run_suite(target, select(cases))
    verdicts = {c["id"]: (c["verdict"], c["violations"]) for c in record.cases}
    assert verdicts == {case: ("pass", []) for case in cases}
    limited = record.case("error-concurrency-limit")["outputs"]["error"]
    assert (limited["status"], limited["code"]) == (429, "concurrency_limit")
    assert limited["headers"]["retry-after"] == "seconds>=1"
    refused = record.case("error-model-not-permitted")["outputs"]
    assert (refused["error"]["status"], refused["error"]["code"]) == (403, "model_not_permitted")
    assert refused["models_listed"] == {"status": 200, "value": []}
    internal = record.case("error-internal")
    assert (internal["outputs"]["error"]["status"], internal["outputs"]["error"]["code"]) == (
        500,
        "internal_error",
    )
    assert internal["outputs"]["error"]["headers"]["x-should-retry"] == "false"
    assert internal["observation"]["served_after_the_fault"] is True


def test_the_fault_needs_a_key(keyed_url):
    """An injected fault sits behind authentication: a caller without a key gets its 401."""
    import httpx

    body = {"model": "conformance-keyed", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(
        f"{keyed_url}/v1/chat/completions",
        json=body,
        headers={"X-Fault-Injection": "internal_error"},
        timeout=30,
    )
    assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key")
