"""Request limits and per-key budgets.

Static limits (n, max_tokens, stop sequences, grammar and tool sizes, prompt tokens) are
checked before any model state is allocated; each rejection names the limit that fired.
Budgets (concurrent requests and tokens per minute, per key) live in one `UsageLedger` actor
shared by every ingress replica: a request reserves on admission (its prompt tokens plus the
most it may generate) and settles to its measured usage when it ends, also on cancel and
failure, so nothing stays reserved after the request is gone.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from serve_app import errors
from serve_app.access.keys import Principal, require_model
from serve_app.named_actors import get_or_create

logger = logging.getLogger(__name__)

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

LEDGER_NAMESPACE = "serve-app"
WINDOW_S = 60.0
# A reservation whose ingress replica died without settling frees itself after this long.
DEFAULT_LEASE_S = 3600.0
CONCURRENCY_RETRY_AFTER_S = 1.0
# How long a response's last bytes wait for the ledger to record its settlement; past it
# they go out and the settlement lands when the ledger answers.
SETTLE_WAIT_S = 5.0
# The 429 code of each budget.
LIMIT_CODES = {
    "max_concurrent_requests": "concurrency_limit",
    "tokens_per_minute": "token_rate_limit",
}


def _tightest(*limits: int | None) -> int | None:
    given = [x for x in limits if x is not None]
    return min(given) if given else None


# --------------------------------------------------------------------- static checks


def check_request(principal: Principal, req: Any, server: Any) -> None:
    """Permission and size checks on a parsed OpenAI request, before any content is
    loaded. `server` is the ServeConfig's LimitOptions."""
    require_model(principal, req.model)
    key = principal.limits
    n = req.n or 1
    max_n = _tightest(server.max_n, key.max_n)
    if max_n is not None and n > max_n:
        raise errors.request_limit_exceeded("max_n", n, max_n, "n")
    requested = req.requested_max_tokens()
    cap = _tightest(server.max_output_tokens, key.max_output_tokens)
    if requested is not None and cap is not None and requested > cap:
        raise errors.max_tokens_exceeded(
            f"max_tokens is {requested}; the limit max_output_tokens allows at most {cap}."
        )
    num_stops = len(req.stop_strings())
    max_stops = _tightest(server.max_stop_sequences, key.max_stop_sequences)
    if max_stops is not None and num_stops > max_stops:
        raise errors.request_limit_exceeded("max_stop_sequences", num_stops, max_stops, "stop")
    spec = req.grammar_spec()
    if spec is not None and key.max_grammar_bytes is not None:
        size = len(spec.spec.encode())
        if size > key.max_grammar_bytes:
            param = req.grammar_param() or "response_format"
            raise errors.request_limit_exceeded(
                "max_grammar_bytes", size, key.max_grammar_bytes, param
            )
    check_tools(getattr(req, "tools", None), key, server)


def check_tools(tools: list[Any] | None, key: Any, server: Any) -> None:
    if not tools:
        return
    max_tools = _tightest(getattr(server, "max_tools", None), key.max_tools)
    if max_tools is not None and len(tools) > max_tools:
        raise errors.request_limit_exceeded("max_tools", len(tools), max_tools, "tools")
    max_bytes = _tightest(getattr(server, "max_tool_bytes", None), key.max_tool_bytes)
    if max_bytes is not None:
        dumped = [t.model_dump() if hasattr(t, "model_dump") else t for t in tools]
        size = len(json.dumps(dumped, separators=(",", ":")).encode())
        if size > max_bytes:
            raise errors.request_limit_exceeded("max_tool_bytes", size, max_bytes, "tools")


def check_prompt_tokens(principal: Principal, prompts: list[list[int]], param: str) -> None:
    bound = principal.limits.max_prompt_tokens
    if bound is None:
        return
    for ids in prompts:
        if len(ids) > bound:
            raise errors.context_length_exceeded(
                f"The prompt has {len(ids)} tokens; the limit max_prompt_tokens allows at "
                f"most {bound}.",
                param=param,
            )


# ---------------------------------------------------------------------------- ledger


@dataclass(frozen=True)
class Verdict:
    """The ledger's answer to a reservation: an id, or the limit that refused it."""

    reservation_id: str | None
    limit: str | None = None  # "max_concurrent_requests" | "tokens_per_minute"
    message: str = ""
    retry_after_s: float = 0.0


@dataclass
class _Reservation:
    key_id: str
    tokens: int
    expires_at: float


class UsageLedger:
    """Per-key live reservations and the tokens spent in the last `window_s` seconds.

    Invariants: a live reservation counts against both budgets until settled; settling is
    idempotent; a reservation not settled within `lease_s` (its ingress died) is dropped."""

    def __init__(
        self,
        window_s: float = WINDOW_S,
        lease_s: float = DEFAULT_LEASE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s, self.lease_s, self.clock = window_s, lease_s, clock
        self._live: dict[str, dict[str, _Reservation]] = {}
        self._spent: dict[str, deque[tuple[float, int]]] = {}

    def reserve(
        self,
        key_id: str,
        tokens: int,
        max_concurrent: int | None,
        tokens_per_minute: int | None,
    ) -> Verdict:
        now = self.clock()
        live = self._live.setdefault(key_id, {})
        for rid in [r for r, res in live.items() if res.expires_at <= now]:
            del live[rid]
        if max_concurrent is not None and len(live) >= max_concurrent:
            return Verdict(
                None,
                "max_concurrent_requests",
                f"This API key has {len(live)} requests in flight; the limit "
                f"max_concurrent_requests is {max_concurrent}.",
                CONCURRENCY_RETRY_AFTER_S,
            )
        if tokens_per_minute is not None:
            # A request may hold at most the whole minute's budget (settled to usage later).
            tokens = min(tokens, tokens_per_minute)
            used = self._spent_tokens(key_id, now) + sum(r.tokens for r in live.values())
            if used + tokens > tokens_per_minute:
                return Verdict(
                    None,
                    "tokens_per_minute",
                    f"This API key used or reserved {used} tokens in the last minute; this "
                    f"request needs up to {tokens} and the limit tokens_per_minute is "
                    f"{tokens_per_minute}.",
                    self._retry_after(key_id, now, used + tokens - tokens_per_minute),
                )
        rid = uuid.uuid4().hex
        live[rid] = _Reservation(key_id, tokens, now + self.lease_s)
        return Verdict(rid)

    def settle(self, key_id: str, reservation_id: str, tokens: int) -> bool:
        """Replace the reservation by `tokens` actually used; False if already settled."""
        if self._live.get(key_id, {}).pop(reservation_id, None) is None:
            return False
        if tokens > 0:
            self._spent.setdefault(key_id, deque()).append((self.clock(), tokens))
        return True

    def usage(self, key_id: str) -> dict[str, int]:
        """What a key holds now: live reservations, reserved and spent tokens."""
        live = self._live.get(key_id, {})
        return {
            "live_requests": len(live),
            "reserved_tokens": sum(r.tokens for r in live.values()),
            "spent_tokens": self._spent_tokens(key_id, self.clock()),
        }

    def _spent_tokens(self, key_id: str, now: float) -> int:
        spent = self._spent.get(key_id)
        if not spent:
            return 0
        while spent and spent[0][0] <= now - self.window_s:
            spent.popleft()
        return sum(t for _, t in spent)

    def _retry_after(self, key_id: str, now: float, needed: int) -> float:
        """When enough spent tokens leave the window (live reservations: soon, 1 s)."""
        freed = 0
        for at, tokens in self._spent.get(key_id, ()):
            freed += tokens
            if freed >= needed:
                return max(1.0, at + self.window_s - now)
        return CONCURRENCY_RETRY_AFTER_S


# ----------------------------------------------------------------- request metering


@dataclass
class Meter:
    """One request's reservation and its measured usage (set when the request ends)."""

    key_id: str | None = None
    reservation_id: str | None = None
    prompt_tokens: int = 0
    measured_tokens: int | None = None

    @property
    def charged_tokens(self) -> int:
        # NOTE: a cancelled or failed request without a measurement is charged its prompt
        # (prefill ran or may have run); its partial output is not counted.
        return self.prompt_tokens if self.measured_tokens is None else self.measured_tokens


# The request's meter, set by the admission middleware around the whole request (stream
# included); child tasks see the same Meter object.
_METER: contextvars.ContextVar[Meter | None] = contextvars.ContextVar("meter", default=None)


def record_usage(total_tokens: int) -> None:
    """The endpoint's measured usage (prompt + output tokens of every choice)."""
    meter = _METER.get()
    if meter is not None:
        meter.measured_tokens = total_tokens


def ledger_name(app_id: str) -> str:
    return f"ledger:{app_id}"


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


async def reserve_budget(
    request: Any, req: Any, prompts: list[list[int]], default_max: int, param: str
) -> int:
    """After tokenization, before the engine: the key's prompt limit, then its budgets.
    Returns the default max_tokens capped by the key's max_output_tokens."""
    from serve_app.access.keys import principal_of

    principal = principal_of(request)
    check_prompt_tokens(principal, prompts, param)
    cap = principal.limits.max_output_tokens
    default_max = default_max if cap is None else min(default_max, cap)
    limiter = (request.scope.get("state") or {}).get(LIMITER_STATE_KEY)
    if limiter is not None:
        max_new = (req.requested_max_tokens() or default_max) * (req.n or 1) * len(prompts)
        await limiter.reserve(principal, sum(len(p) for p in prompts), max_new)
    return default_max
