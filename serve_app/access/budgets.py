"""Per-key budgets at an ingress replica: concurrent requests and tokens per minute.

`Limiter` reserves against the `UsageLedger` actor (`serve_app.access.ledger`) on admission
and settles to the request's measured usage (its `Meter`) when the response ends, also on
cancel and failure. `reserve_budget` is the endpoints' hook between tokenization and the
engine.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from serve_app import errors
from serve_app.access.keys import Principal, principal_of
from serve_app.access.ledger import LEDGER_NAMESPACE, UsageLedger, Verdict, ledger_name
from serve_app.named_actors import get_or_create

logger = logging.getLogger(__name__)

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

# How long a response's last bytes wait for the ledger to record its settlement; past it
# they go out and the settlement lands when the ledger answers.
SETTLE_WAIT_S = 5.0
# The 429 code of each budget.
LIMIT_CODES = {
    "max_concurrent_requests": "concurrency_limit",
    "tokens_per_minute": "token_rate_limit",
}


# ----------------------------------------------------------------- request metering


@dataclass
class Meter:
    """One request's reservation and its measured usage (set when the request ends)."""

    key_id: str | None = None
    reservation_id: str | None = None
    prompt_tokens: int = 0
    measured_tokens: int | None = None
    # A stream's running count (prompt + output so far), read when the request ends without
    # a measurement: a client that left mid-stream is charged what was produced.
    measure: Callable[[], int] | None = None

    @property
    def charged_tokens(self) -> int:
        if self.measured_tokens is not None:
            return self.measured_tokens
        if self.measure is not None:
            return self.measure()
        # NOTE: a request that failed before any output is charged its prompt (prefill ran
        # or may have run).
        return self.prompt_tokens


# The request's meter, set by the admission middleware around the whole request (stream
# included); child tasks see the same Meter object.
_METER: contextvars.ContextVar[Meter | None] = contextvars.ContextVar("meter", default=None)


def measure_usage(measure: Callable[[], int]) -> None:
    """Let the request's meter read its usage so far (`Meter.measure`), however it ends."""
    meter = _METER.get()
    if meter is not None:
        meter.measure = measure


def record_usage(total_tokens: int) -> None:
    """The endpoint's measured usage (prompt + output tokens of every choice)."""
    meter = _METER.get()
    if meter is not None:
        meter.measured_tokens = total_tokens


class Limiter:
    """An ingress replica's side of the ledger: reserve, settle, and the request's Meter."""

    def __init__(self, app_id: str) -> None:
        self.app_id = app_id
        self._ledger: Any = None

    def _get_ledger(self) -> Any:
        if self._ledger is None:
            self._ledger = get_or_create(UsageLedger, ledger_name(self.app_id), LEDGER_NAMESPACE)
        return self._ledger

    def start(self) -> contextvars.Token:
        return _METER.set(Meter())

    def settling(self, send: Send) -> Send:
        """`send`, settling the request's reservation before the response's last bytes go
        out and waiting for the ledger to record it: a client that holds the whole answer
        finds it in the key's usage, as does its next request on any replica."""
        meter = _METER.get()

        async def send_settled(message: MutableMapping[str, Any]) -> None:
            if (
                meter is not None
                and meter.reservation_id is not None
                and message["type"] == "http.response.body"
                and not message.get("more_body", False)
            ):
                reservation_id, meter.reservation_id = meter.reservation_id, None
                # Submitted before the await: a cancellation here still settles it.
                settled = self._settle(meter.key_id, reservation_id, meter.charged_tokens)
                if settled is not None:
                    await asyncio.wait([asyncio.ensure_future(settled)], timeout=SETTLE_WAIT_S)
            await send(message)

        return send_settled

    def finish(self, token: contextvars.Token) -> None:
        """Settle the request's reservation if the response did not (a client that left, an
        error): fire and forget, so it is safe inside a cancellation."""
        meter = _METER.get()
        _METER.reset(token)
        if meter is not None and meter.reservation_id is not None:
            self._settle(meter.key_id, meter.reservation_id, meter.charged_tokens)

    async def reserve(self, principal: Principal, prompt_tokens: int, max_new_tokens: int) -> None:
        """Admit against the key's budgets or raise 429 naming the limit."""
        meter = _METER.get()
        if meter is not None:
            meter.prompt_tokens = prompt_tokens
        reservation_id = await self.reserve_detached(principal, prompt_tokens, max_new_tokens)
        if meter is not None and reservation_id is not None:
            meter.key_id, meter.reservation_id = principal.key_id, reservation_id

    async def reserve_detached(
        self, principal: Principal, prompt_tokens: int, max_new_tokens: int
    ) -> str | None:
        """Like `reserve`, for work that outlives its request (generation resources): the
        caller keeps the reservation id (None: the key has no budgets) and settles it with
        `settle_detached` when the work ends."""
        limits = principal.limits
        if principal.key_id is None or (
            limits.max_concurrent_requests is None and limits.tokens_per_minute is None
        ):
            return None
        verdict = await self._reserve_once(principal, prompt_tokens + max_new_tokens)
        if verdict.reservation_id is None:
            raise errors.limit_exceeded(
                LIMIT_CODES[verdict.limit or ""], verdict.message, verdict.retry_after_s
            )
        return verdict.reservation_id

    def settle_detached(self, key_id: str, reservation_id: str, tokens: int) -> None:
        """Settle a `reserve_detached` reservation to its measured tokens (fire and forget)."""
        self._settle(key_id, reservation_id, tokens)

    def settlement(self, key_id: str | None, reservation_id: str) -> Callable[[int], None]:
        """`settle_detached` of one reservation as a call another process can make (work
        handed to another deployment settles there): it names the ledger, not this limiter."""
        return functools.partial(settle_in_ledger, self.app_id, key_id, reservation_id)

    def _settle(self, key_id: str | None, reservation_id: str, tokens: int) -> Any:
        """Submit the settlement; its ObjectRef, or None when the ledger is unreachable."""
        try:
            return self._get_ledger().settle.remote(key_id, reservation_id, tokens)
        except Exception:  # noqa: BLE001 (a lost ledger forgets its reservations anyway)
            logger.warning("could not settle a reservation: ledger unavailable")
            self._ledger = None
            return None

    async def _reserve_once(self, principal: Principal, tokens: int) -> Verdict:
        limits = principal.limits
        args = (principal.key_id, tokens, limits.max_concurrent_requests, limits.tokens_per_minute)
        try:
            return await self._get_ledger().reserve.remote(*args)
        except Exception:  # noqa: BLE001 (the ledger died with its owner: make a new one)
            self._ledger = None
            return await self._get_ledger().reserve.remote(*args)


# -------------------------------------------------------------------- endpoint hooks

LIMITER_STATE_KEY = "limiter"


async def reserve_budget(request: Any, req: Any, prompts: list[list[int]], max_tokens: int) -> None:
    """After the output budget is decided, before the engine: reserve against the key's
    budgets (its prompt tokens plus the most every choice may generate), or 429."""
    limiter = (request.scope.get("state") or {}).get(LIMITER_STATE_KEY)
    if limiter is not None:
        max_new = max_tokens * (req.n or 1) * len(prompts)
        await limiter.reserve(principal_of(request), sum(len(p) for p in prompts), max_new)


def settle_in_ledger(app_id: str, key_id: str | None, reservation_id: str, tokens: int) -> None:
    """Settle a detached reservation from any process of the app (fire and forget)."""
    try:
        ledger = get_or_create(UsageLedger, ledger_name(app_id), LEDGER_NAMESPACE)
        ledger.settle.remote(key_id, reservation_id, tokens)
    except Exception:  # noqa: BLE001 (a lost ledger forgets its reservations anyway)
        logger.warning("could not settle a reservation: ledger unavailable")
