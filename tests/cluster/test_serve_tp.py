"""An engine replica with TP=2 under Serve: its ranks live in the replica's placement group."""

from __future__ import annotations

import httpx
import pytest

from actors import LLM, SamplingParams

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def tp2_url(serve_url, model_dirs):
    from ray import serve

    from serve_app.app import build_app
    from serve_app.config.options import ServeConfig
    from tests.support.ports import free_port

    config = ServeConfig(
        model=str(model_dirs("llama")),
        served_model_name="tiny-tp2",
        admin_port=free_port(),
        engine={"tensor_parallel_size": 2},
    )
    serve.run(build_app(config), name="tp2", route_prefix="/tp2", blocking=False)
    url = f"{serve_url}/tp2"
    from serve_app.server import wait_healthy

    wait_healthy(url, timeout_s=180)
    yield url
    serve.delete("tp2")


def test_tp2_replica_serves_the_same_tokens_from_its_own_placement_group(
    tp2_url, model_dirs, ray_session
):
    body = {
        "model": "tiny-tp2",
        "prompt": "The quick brown fox",
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(f"{tp2_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    offline = LLM(model=str(model_dirs("llama"))).generate(
        ["The quick brown fox"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    assert r.json()["choices"][0]["text"] == offline[0].text
    live = [
        pg for pg in ray_session.util.placement_group_table().values() if pg["state"] == "CREATED"
    ]
    # Only the replica's group (its own bundle + one per rank): the executor made none.
    assert [len(pg["bundles"]) for pg in live] == [3]
    info = httpx.get(f"{tp2_url}/v1/server_info").json()
    assert info["engine"]["tensor_parallel_size"] == 2
