"""The usage ledger: per-key live reservations and the tokens spent in the last minute.

One `UsageLedger` actor per app, shared by every ingress replica: a request reserves on
admission (its prompt tokens plus the most it may generate) and settles to its measured usage
when it ends, also on cancel and failure, so nothing stays reserved after the request is gone.
A reservation whose ingress replica died without settling frees itself after its lease.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

LEDGER_NAMESPACE = "serve-app"
WINDOW_S = 60.0
# A reservation whose ingress replica died without settling frees itself after this long.
DEFAULT_LEASE_S = 3600.0
CONCURRENCY_RETRY_AFTER_S = 1.0


def ledger_name(app_id: str) -> str:
    return f"ledger:{app_id}"


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
