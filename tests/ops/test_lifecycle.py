"""Request lifecycle over HTTP: disconnects cancel and free everything; the admin API."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.support.admin import replica_stat, wait_replica_stat

pytestmark = pytest.mark.serve

IDLE = {"kv_blocks_used": 0, "live_requests": 0, "running": 0, "waiting": 0, "held": 0}


def _stream_body(model_id: str, max_tokens: int) -> dict:
    return {
        "model": model_id,
        "prompt": "Once upon a time there was a paged cache",
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _idle_totals(admin_url: str) -> dict:
    stats = httpx.get(f"{admin_url}/admin/v1/stats").json()
    # Totals over no reporting replica would look idle: require the replica to be there.
    assert len(stats["replicas"]) == 1, stats
    return {k: stats["total"][k] for k in IDLE}


def _wait_idle(admin_url: str, within_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        if _idle_totals(admin_url) == IDLE:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"not back to idle within {within_s}s: {_idle_totals(admin_url)}")


def test_admin_stats_per_replica_and_total_and_absent_on_public_port(
    serve_url, admin_url, model_id
):
    def read() -> dict:
        return httpx.get(f"{admin_url}/admin/v1/stats").json()

    before = read()["total"]
    body = {"model": model_id, "prompt": [5, 6, 7, 8], "max_tokens": 6, "ignore_eos": True}
    assert httpx.post(f"{serve_url}/v1/completions", json=body, timeout=60).status_code == 200
    # The request's prefill step and five decode steps, once the replica has reported them.
    deadline = time.monotonic() + 5
    while (stats := read())["total"]["steps_total"] - before["steps_total"] < 6:
        assert time.monotonic() < deadline, f"the request's steps never reached {stats}"
        time.sleep(0.05)
    assert stats["total"]["requests_total"] > before["requests_total"]
    assert len(stats["replicas"]) == 1
    replica = stats["replicas"][0]
    for key in (
        *("kv_blocks_total", "kv_blocks_used", "running", "waiting", "held"),
        *("requests_total", "steps_total"),
    ):
        assert replica[key] == stats["total"][key]
    assert replica["node_id"] and replica["kv_blocks_total"] > 0
    for method, path in (("GET", "/admin/v1/stats"), ("POST", "/admin/v1/drain")):
        assert httpx.request(method, f"{serve_url}{path}").status_code == 404


def test_half_of_200_streams_disconnect_and_everything_is_released(serve_url, admin_url, model_id):
    max_tokens = 24

    async def client(i: int, http: httpx.AsyncClient) -> dict | None:
        # The leavers ask for 1000 tokens: were they not cancelled, the engine would still
        # be busy with them long after the 2 s below.
        disconnect = i % 2 == 0
        body = _stream_body(model_id, 1000 if disconnect else max_tokens)
        chunks = 0
        last = None
        async with http.stream("POST", f"{serve_url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks += 1
                last = json.loads(line[6:])
                if disconnect and chunks == 3:
                    return None  # leaving the block closes the connection mid-stream
        return last

    async def run_all() -> list:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            return await asyncio.gather(*(client(i, http) for i in range(200)))

    late_before = replica_stat(admin_url, "outputs_after_cancel")
    results = asyncio.run(run_all())
    finished = [r for r in results if r is not None]
    assert len(finished) == 100
    for usage_chunk in finished:
        assert usage_chunk.get("choices") == [], usage_chunk
        assert usage_chunk["usage"]["completion_tokens"] == max_tokens
    # Everything the disconnected half held (KV blocks, queues, live requests) is released.
    _wait_idle(admin_url, within_s=2.0)
    # Once the cancellation reached the engine, each leaver ran in at most one step begun
    # after it (the one that may start while the abort is being queued); the fence dropped
    # its output. (Outputs computed before the cancel and still queued are fenced too.)
    assert replica_stat(admin_url, "outputs_after_cancel") - late_before <= 100
    after = httpx.post(
        f"{serve_url}/v1/completions",
        json={"model": model_id, "prompt": "again", "max_tokens": 4, "ignore_eos": True},
        timeout=60,
    )
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4


def test_concurrent_streams_travel_in_the_output_channel_many_outputs_per_item(
    serve_url, admin_url, model_id
):
    """Tokens after each stream's first reach the ingress in its channel, one item per
    engine wake-up for every stream (not one Serve item per token), and the streams are
    whole. Long enough that the streams' decodes overlap on a loaded machine (streams
    admitted one after another share no wake-up)."""
    max_tokens, streams = 64, 8

    async def client(http: httpx.AsyncClient) -> int:
        """The tokens the ingress received for the stream (its usage chunk counts them)."""
        received = -1
        body = _stream_body(model_id, max_tokens)
        async with http.stream("POST", f"{serve_url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and not json.loads(line[6:])["choices"]:
                    received = json.loads(line[6:])["usage"]["completion_tokens"]
        return received

    async def run_all() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(client(http) for _ in range(streams)))

    # The ingress opens its channel when a request of its comes back unchannelled, and a
    # channel with no request for IDLE_S (2 s) ends: one request first, so that the measured
    # streams find it open whatever the tests before left.
    warm = httpx.post(
        f"{serve_url}/v1/completions",
        json={"model": model_id, "prompt": "warm", "max_tokens": 4, "ignore_eos": True},
        timeout=60,
    )
    assert warm.status_code == 200
    # The channel opens in the background: a stream routed before it is open is unchannelled.
    channels = wait_replica_stat(admin_url, "output_channels", 1, timeout_s=10)
    assert channels >= 1, "the ingress's output channel did not open"
    items_before = replica_stat(admin_url, "channel_items")
    outputs_before = replica_stat(admin_url, "channel_outputs")
    received = asyncio.run(run_all())
    # Every token of every stream arrived.
    assert received == [max_tokens] * streams
    wanted = streams * (max_tokens - 1)
    outputs = (
        wait_replica_stat(admin_url, "channel_outputs", outputs_before + wanted, timeout_s=5)
        - outputs_before
    )
    items = replica_stat(admin_url, "channel_items") - items_before
    assert outputs >= wanted
    assert items < outputs / 2


def test_drain_refuses_new_requests_until_lifted(serve_url, admin_url, model_id):
    body = {"model": model_id, "prompt": "x", "max_tokens": 2}
    try:
        assert httpx.post(f"{admin_url}/admin/v1/drain").json()["draining"] is True
        time.sleep(0.6)  # the ingress reads the flag at most twice a second
        r = httpx.post(f"{serve_url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        assert int(r.headers["retry-after"]) >= 1
    finally:
        lifted = httpx.post(f"{admin_url}/admin/v1/drain", json={"draining": False}).json()
        assert lifted["draining"] is False
    time.sleep(0.6)
    assert httpx.post(f"{serve_url}/v1/completions", json=body, timeout=30).status_code == 200


def test_request_metrics_reach_prometheus(serve_url, model_id, ray_session):
    """TTFT/ITL/e2e/queue histograms, outcome and token counters, engine gauges."""
    body = {"model": model_id, "prompt": "metrics", "max_tokens": 6, "stream": True}
    with httpx.stream("POST", f"{serve_url}/v1/completions", json=body) as r:
        assert r.status_code == 200 and list(r.iter_lines())
    bad = httpx.post(f"{serve_url}/v1/completions", json={**body, "bogus": 1})
    assert bad.status_code == 400
    # A client that leaves is counted as a cancel, apart from errors and timeouts.
    leaving = {**body, "max_tokens": 500, "ignore_eos": True}
    with httpx.stream("POST", f"{serve_url}/v1/completions", json=leaving) as r:
        lines = r.iter_lines()
        next(lines)
    node = ray_session._private.worker.global_worker.node
    url = f"http://127.0.0.1:{node.metrics_export_port}/metrics"
    wanted = [
        "serve_app_ttft_seconds",
        "serve_app_itl_seconds",
        "serve_app_e2e_seconds",
        "serve_app_queue_seconds",
        'serve_app_requests_total{Component="core_worker"',
        'code="unknown_parameter"',
        'outcome="cancelled"',
        'code="client_disconnect"',
        "serve_app_tokens_total",
        "serve_app_engine_kv_blocks_total",
    ]
    deadline = time.monotonic() + 60
    missing = wanted
    while time.monotonic() < deadline:
        text = httpx.get(url, timeout=10).text
        missing = [w for w in wanted if w not in text]
        if not missing:
            return
        time.sleep(1)
    raise AssertionError(f"metrics never exported: {missing}")
