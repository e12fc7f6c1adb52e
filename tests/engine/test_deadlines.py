"""Client deadlines: the cost-model veto before prefill, and `timeout` while running."""

from __future__ import annotations

import time

import httpx
import pytest

from actors import LLM, SamplingParams
from actors.deadlines import CostModel, DeadlineConfig, RequestRejected


def test_cost_model_tracks_measured_steps():
    cost = CostModel()
    assert cost.time_to_first_token(1000, 100) == 0.0  # unmeasured: vetoes nothing
    cost.observe(0.1, 100)  # a prefill-heavy step: 1 ms per token
    cost.observe(0.004, 2)  # a near-empty step: the fixed overhead
    assert cost.time_to_first_token(0, 100) == pytest.approx(0.1 + 0.004)
    for _ in range(50):
        cost.observe(0.2, 100)
        cost.observe(0.01, 30)  # mid-sized steps teach neither
    assert cost.seconds_per_token == pytest.approx(0.002, rel=1e-3)
    assert cost.seconds_per_step == pytest.approx(0.004)


@pytest.fixture()
def engine(model_dirs):
    llm = LLM(model=str(model_dirs("llama")))
    llm.generate([list(range(5, 300))], SamplingParams(max_tokens=4))  # measure the cost
    return llm.engine


def _drain(engine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_deadline_below_an_idle_servers_need_is_too_short(engine):
    with pytest.raises(RequestRejected) as info:
        engine.add_request("r", list(range(5, 900)), SamplingParams(max_tokens=2), timeout_s=1e-6)
    assert info.value.code == "deadline_too_short"
    assert engine.stats()["live_requests"] == 0


def test_queue_makes_a_deadline_unmeetable_before_prefill(engine):
    for i in range(30):
        engine.add_request(f"bulk{i}", list(range(5, 900)), SamplingParams(max_tokens=2))
    alone = engine.cost.time_to_first_token(0, 20)
    with pytest.raises(RequestRejected) as info:
        engine.add_request(
            "late", list(range(5, 25)), SamplingParams(max_tokens=2), timeout_s=2 * alone
        )
    assert info.value.code == "deadline_unmeetable" and info.value.retry_after_s >= 1
    _drain(engine)


def test_running_request_ends_with_timeout_and_keeps_its_output(engine):
    engine.add_request(
        "slow", [5, 6, 7], SamplingParams(max_tokens=1000, ignore_eos=True), timeout_s=0.3
    )
    outs = _drain(engine)["slow"]
    tokens = [t for o in outs for d in o.deltas for t in d.token_ids]
    assert outs[-1].finished and outs[-1].deltas[-1].finish_reason == "timeout"
    assert 0 < len(tokens) < 1000
    assert engine.stats()["kv_blocks_used"] == 0


def test_deadline_passing_in_the_queue_is_unmeetable(engine):
    engine.cost = CostModel()  # unmeasured: admission vetoes nothing, the tracker decides
    engine.add_request("q", [5, 6, 7], SamplingParams(max_tokens=5), timeout_s=0.05)
    time.sleep(0.1)  # the deadline passes before the engine ever schedules it
    (out,) = _drain(engine)["q"]
    assert out.error_code == "deadline_unmeetable" and out.finished


def test_server_default_bounds_a_request_that_names_no_deadline(engine):
    engine.deadline_config = DeadlineConfig(default_timeout_s=0.3, max_queue_s=None)
    engine.add_request("open", [5, 6, 7], SamplingParams(max_tokens=1000, ignore_eos=True))
    outs = _drain(engine)["open"]
    assert outs[-1].deltas[-1].finish_reason == "timeout"
    assert 0 < sum(len(d.token_ids) for o in outs for d in o.deltas) < 1000


def test_server_max_queue_time_vetoes_and_expires_waiting_requests(engine):
    for i in range(30):
        engine.add_request(f"bulk{i}", list(range(5, 900)), SamplingParams(max_tokens=2))
    # 1 ms: less than one step, so the newcomer behind 30 prefills cannot be scheduled in it.
    engine.deadline_config = DeadlineConfig(default_timeout_s=None, max_queue_s=0.001)
    # The measured cost puts a newcomer's wait past the queue bound: refused at once.
    with pytest.raises(RequestRejected) as info:
        engine.add_request("late", [5, 6, 7], SamplingParams(max_tokens=2))
    assert info.value.code == "deadline_unmeetable" and info.value.retry_after_s >= 1
    assert "maximum queue time" in str(info.value)
    # Unmeasured (nothing vetoed), the bound still ends a request that waits past it.
    engine.cost = CostModel()
    engine.add_request("late", [5, 6, 7], SamplingParams(max_tokens=2))
    outs = _drain(engine)
    assert outs["late"][-1].error_code == "deadline_unmeetable"
    assert all(o.error_code is None for o in outs["bulk0"])
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.serve
def test_deadlines_over_http(serve_url):
    model = httpx.get(f"{serve_url}/v1/models").json()["data"][0]["id"]
    url = f"{serve_url}/v1/completions"
    warm = {"model": model, "prompt": "warm up", "max_tokens": 4}
    assert httpx.post(url, json=warm, timeout=60).status_code == 200

    too_short = httpx.post(url, json=warm, headers={"X-Request-Timeout-Ms": "0.001"}, timeout=60)
    assert too_short.status_code == 400
    assert too_short.json()["error"]["code"] == "deadline_too_short"
    # The error names where the deadline was set: the header, or the stricter `timeout` field.
    assert too_short.json()["error"]["param"] == "X-Request-Timeout-Ms"
    strict_field = {**warm, "timeout": 0.000001}
    headers = {"X-Request-Timeout-Ms": "60000"}
    by_field = httpx.post(url, json=strict_field, headers=headers, timeout=60).json()["error"]
    assert (by_field["code"], by_field["param"]) == ("deadline_too_short", "timeout")
    bad = httpx.post(url, json=warm, headers={"X-Request-Timeout-Ms": "soon"}, timeout=60)
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "X-Request-Timeout-Ms")

    # 1000 tokens take well over 0.2 s (5,000 tokens/s would be several times what one stream
    # of the tiny model makes on a fast CPU); the first comes long before the deadline.
    body = {"model": model, "prompt": "go", "max_tokens": 1000, "ignore_eos": True, "timeout": 0.2}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "timeout"
