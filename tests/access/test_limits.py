"""Per-request limits and per-key budgets, without Ray: each rejection names its limit; the
ledger reserves on admission, settles to measured usage, and never leaks a reservation."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from serve_app import errors
from serve_app.access.budgets import Limiter, Meter, record_usage
from serve_app.access.keys import OPEN_PRINCIPAL, KeyLimits, Principal
from serve_app.access.ledger import UsageLedger
from serve_app.access.output_budget import (
    BudgetRules,
    output_budget,
    server_and_key_caps,
)
from serve_app.access.static_limits import check_request, check_tools
from serve_app.config.options import LimitOptions
from serve_app.protocol import parse_request
from tests.support.clock import ManualClock


def principal(**limits: Any) -> Principal:
    return Principal(tenant="t", key_id="k", models=frozenset({"m"}), limits=KeyLimits(**limits))


def chat(**fields: Any):
    return parse_request(
        "chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


# ------------------------------------------------------------------- static checks

LIMITED = principal(max_n=2, max_output_tokens=16, max_stop_sequences=1, max_grammar_bytes=40)
SCHEMA = {"type": "object", "properties": {"a_long_property_name": {"type": "string"}}}

CASES = [
    # (request fields, status, code, the limit named in the message, param)
    ({"n": 3}, 400, "request_limit_exceeded", "max_n", "n"),
    ({"stop": ["a", "b"]}, 400, "request_limit_exceeded", "max_stop_sequences", "stop"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": SCHEMA},
            }
        },
        400,
        "request_limit_exceeded",
        "max_grammar_bytes",
        "response_format.json_schema.schema",
    ),
]


@pytest.mark.parametrize(("fields", "status", "code", "limit", "param"), CASES)
def test_each_key_limit_rejects_naming_itself(fields, status, code, limit, param):
    with pytest.raises(errors.APIError) as info:
        check_request(LIMITED, chat(**fields), LimitOptions())
    err = info.value
    assert (err.status, err.code, err.param) == (status, code, param)
    assert limit in err.message and err.headers["x-should-retry"] == "false"


def test_within_limits_passes_and_the_tighter_of_server_and_key_wins():
    check_request(LIMITED, chat(n=2, max_tokens=16, stop="x"), LimitOptions())
    with pytest.raises(errors.APIError, match="max_n"):
        check_request(OPEN_PRINCIPAL, chat(n=3), LimitOptions(max_n=2))


# ------------------------------------------------------------------ output budget


def budget(requested, *, server=None, key=None, prompts=(10,), default=None, **kw):
    return output_budget(
        requested,
        default=default,
        caps=server_and_key_caps(server, key),
        context=64,
        prompt_lengths=list(prompts),
        prompt_param="messages",
        **kw,
    )


def test_the_output_budget_is_the_request_within_every_cap_and_the_context():
    assert budget(16, server=32, key=16) == 16
    with pytest.raises(errors.APIError, match="the server's limit max_output_tokens allows at mo"):
        budget(9, server=8, key=16)
    with pytest.raises(errors.APIError) as info:  # the key's cap, named as the key's
        budget(17, server=32, key=16)
    err = info.value
    assert (err.status, err.code, err.param) == (400, "max_tokens_exceeded", "max_tokens")
    assert "the API key's limit max_output_tokens allows at most 16" in err.message
    with pytest.raises(errors.APIError, match="maximum context length is 64") as info:
        budget(40, prompts=(10, 30))  # the longest prompt decides
    assert info.value.code == "max_tokens_exceeded"
    with pytest.raises(errors.APIError, match="leaving no room") as info:
        budget(None, prompts=(64,))
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "messages")


def test_without_a_request_the_budget_is_the_default_lowered_to_caps_and_room():
    assert budget(None) == 54  # OpenAI's default: the room the prompt leaves
    assert budget(None, server=32, key=20) == 20
    assert budget(None, prompts=(10, 50)) == 14
    assert budget(None, default=128, prompts=(60,)) == 4  # batch: its default, lowered to fit
    assert budget(None, default=8) == 8


def test_a_family_words_and_classes_its_own_refusals():
    rules = BudgetRules("max_output_tokens", 422, "context_length_exceeded", "input")
    with pytest.raises(errors.APIError) as info:
        budget(60, rules=rules)
    assert (info.value.status, info.value.code, info.value.param) == (
        422, "context_length_exceeded", "input",
    )  # fmt: skip
    with pytest.raises(errors.APIError) as info:
        budget(20, key=16, rules=rules)
    assert (info.value.status, info.value.param) == (422, "max_output_tokens")
    assert info.value.message.startswith("max_output_tokens is 20;")


def test_a_model_the_key_lacks_is_403_before_anything_else():
    req = parse_request("chat", {"model": "other", "messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(errors.APIError) as info:
        check_request(LIMITED, req, LimitOptions())
    assert (info.value.status, info.value.code) == (403, "model_not_permitted")


def test_tool_definitions_are_bounded_in_number_and_size():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(errors.APIError, match="max_tools") as info:
        check_tools([tool] * 3, KeyLimits(max_tools=2), LimitOptions())
    assert (info.value.status, info.value.param) == (400, "tools")
    with pytest.raises(errors.APIError, match="max_tool_bytes"):
        check_tools([tool], KeyLimits(max_tool_bytes=20), LimitOptions())
    with pytest.raises(errors.APIError, match="max_tools"):
        check_tools([tool] * 3, KeyLimits(), LimitOptions(max_tools=2))
    check_tools([tool] * 2, KeyLimits(max_tools=2), LimitOptions())


# ------------------------------------------------------------------------ ledger


def test_concurrency_is_per_key_and_a_settled_request_frees_its_slot():
    ledger = UsageLedger(clock=ManualClock())
    first = ledger.reserve("k", 10, max_concurrent=1, tokens_per_minute=None)
    assert first.reservation_id is not None
    refused = ledger.reserve("k", 10, max_concurrent=1, tokens_per_minute=None)
    assert refused.reservation_id is None and refused.limit == "max_concurrent_requests"
    assert refused.retry_after_s >= 1 and "max_concurrent_requests is 1" in refused.message
    assert ledger.reserve("other", 10, 1, None).reservation_id is not None
    assert ledger.settle("k", first.reservation_id, 7)
    assert not ledger.settle("k", first.reservation_id, 7)  # settling twice changes nothing
    assert ledger.usage("k") == {"live_requests": 0, "reserved_tokens": 0, "spent_tokens": 7}
    assert ledger.reserve("k", 10, 1, None).reservation_id is not None


def test_token_rate_counts_reservations_then_measured_usage_over_a_sliding_minute():
    clock = ManualClock()
    ledger = UsageLedger(clock=clock)
    a = ledger.reserve("k", 600, None, tokens_per_minute=1000)
    assert a.reservation_id is not None
    # The reservation (600) counts until settled: 600 + 500 > 1000.
    refused = ledger.reserve("k", 500, None, 1000)
    assert refused.limit == "tokens_per_minute" and refused.reservation_id is None
    # Settled to what was used (200): now 200 + 500 fits.
    ledger.settle("k", a.reservation_id, 200)
    b = ledger.reserve("k", 500, None, 1000)
    assert b.reservation_id is not None
    ledger.settle("k", b.reservation_id, 500)
    clock.now += 30
    refused = ledger.reserve("k", 400, None, 1000)
    # 700 spent in the window; the oldest 200 leave it 30 s from now, enough for 400.
    assert refused.limit == "tokens_per_minute" and 29 <= refused.retry_after_s <= 31
    clock.now += 31
    assert ledger.reserve("k", 400, None, 1000).reservation_id is not None


def test_a_request_larger_than_the_minute_budget_waits_for_a_whole_idle_minute():
    clock = ManualClock()
    ledger = UsageLedger(clock=clock)
    big = ledger.reserve("k", 5000, None, tokens_per_minute=1000)
    assert big.reservation_id is not None  # reserves the whole budget, not more
    assert ledger.usage("k")["reserved_tokens"] == 1000
    assert ledger.reserve("k", 1, None, 1000).reservation_id is None


def test_an_unsettled_reservation_expires_after_its_lease():
    clock = ManualClock()
    ledger = UsageLedger(clock=clock, lease_s=60)
    assert ledger.reserve("k", 1, 1, None).reservation_id is not None
    assert ledger.reserve("k", 1, 1, None).reservation_id is None
    clock.now += 61  # its ingress replica died without settling
    assert ledger.reserve("k", 1, 1, None).reservation_id is not None


# ------------------------------------------------------------------------- meter


class FakeLedgerHandle:
    """The actor handle's `.remote` surface over a local ledger."""

    def __init__(self, ledger: UsageLedger) -> None:
        self.ledger = ledger
        outer = self

        class Method:
            def __init__(self, name: str) -> None:
                self.name = name

            def remote(self, *args: Any) -> Any:
                result = getattr(outer.ledger, self.name)(*args)
                future = asyncio.get_running_loop().create_future()
                future.set_result(result)
                return future

        self.reserve, self.settle = Method("reserve"), Method("settle")


class SlowLedgerHandle(FakeLedgerHandle):
    """Settlements reach the ledger a while after they are sent, as over a real actor."""

    def __init__(self, ledger: UsageLedger, delay_s: float) -> None:
        super().__init__(ledger)
        fast_settle = self.settle

        class Settle:
            def remote(self, *args: Any) -> Any:
                loop = asyncio.get_running_loop()
                future = loop.create_future()

                def land() -> None:
                    fast_settle.remote(*args).add_done_callback(
                        lambda done: future.set_result(done.result())
                    )

                loop.call_later(delay_s, land)
                return future

        self.settle = Settle()


def limiter_on(ledger: UsageLedger) -> Limiter:
    limiter = Limiter("test")
    limiter._ledger = FakeLedgerHandle(ledger)
    return limiter


def test_limiter_settles_measured_usage_or_the_prompt_when_the_request_died():
    ledger = UsageLedger(clock=ManualClock())
    limiter = limiter_on(ledger)
    key = principal(max_concurrent_requests=2, tokens_per_minute=10_000)

    async def request(measured: int | None, fail: bool) -> None:
        token = limiter.start()
        try:
            await limiter.reserve(key, prompt_tokens=30, max_new_tokens=100)
            assert ledger.usage("k")["reserved_tokens"] == 130
            if measured is not None:
                record_usage(measured)
            if fail:
                raise asyncio.CancelledError
        finally:
            limiter.finish(token)

    asyncio.run(request(45, fail=False))
    assert ledger.usage("k") == {"live_requests": 0, "reserved_tokens": 0, "spent_tokens": 45}
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(request(None, fail=True))
    # Cancelled before a measurement: charged its prompt, and the slot is free again.
    assert ledger.usage("k") == {"live_requests": 0, "reserved_tokens": 0, "spent_tokens": 75}


def test_a_response_ends_only_once_the_ledger_has_its_settlement():
    ledger = UsageLedger(clock=ManualClock())
    limiter = Limiter("test")
    limiter._ledger = SlowLedgerHandle(ledger, delay_s=0.05)
    key = principal(tokens_per_minute=10_000)
    seen: list[tuple[bool, dict]] = []

    async def client_side(message: dict) -> None:
        seen.append((message.get("more_body", False), ledger.usage("k")))

    async def request() -> None:
        token = limiter.start()
        try:
            send = limiter.settling(client_side)
            await limiter.reserve(key, prompt_tokens=30, max_new_tokens=100)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{", "more_body": True})
            record_usage(41)
            await send({"type": "http.response.body", "body": b"}", "more_body": False})
        finally:
            limiter.finish(token)

    asyncio.run(request())
    reserved = {"live_requests": 1, "reserved_tokens": 130, "spent_tokens": 0}
    assert [usage for _, usage in seen[:2]] == [reserved, reserved]
    # The last bytes went out after the ledger recorded the measured usage, not before.
    assert seen[2] == (False, {"live_requests": 0, "reserved_tokens": 0, "spent_tokens": 41})


def test_limiter_refuses_with_429_naming_the_limit_and_skips_keys_without_budgets():
    ledger = UsageLedger(clock=ManualClock())
    limiter = limiter_on(ledger)
    key = principal(max_concurrent_requests=1)

    async def two_at_once() -> errors.APIError:
        limiter.start()
        await limiter.reserve(key, 10, 10)
        limiter.start()
        with pytest.raises(errors.APIError) as info:
            await limiter.reserve(key, 10, 10)
        return info.value

    err = asyncio.run(two_at_once())
    assert (err.status, err.code) == (429, "concurrency_limit")
    assert int(err.headers["Retry-After"]) >= 1 and "max_concurrent_requests" in err.message
    asyncio.run(limiter.reserve(principal(), 10, 10))  # no budgets: the ledger is not asked
    assert ledger.usage("k")["live_requests"] == 1
    assert Meter(prompt_tokens=5).charged_tokens == 5


@pytest.mark.ray
def test_ingress_replicas_share_one_ledger(ray_session):
    """Two Limiters with one app id (two ingress replicas) see each other's reservations."""
    first, second = Limiter("shared-ledger-test"), Limiter("shared-ledger-test")
    key = principal(max_concurrent_requests=1)

    async def run() -> tuple[str | None, errors.APIError]:
        held = await first.reserve_detached(key, 10, 10)
        with pytest.raises(errors.APIError) as info:
            await second.reserve_detached(key, 10, 10)
        first.settle_detached("k", held, 12)
        deadline = asyncio.get_running_loop().time() + 10
        while asyncio.get_running_loop().time() < deadline:
            try:
                again = await second.reserve_detached(key, 10, 10)
                return again, info.value
            except errors.APIError:
                await asyncio.sleep(0.05)
        raise AssertionError("the settled slot never came back")

    again, refused = asyncio.run(run())
    assert refused.code == "concurrency_limit" and again is not None
    ray_session.kill(first._get_ledger())
