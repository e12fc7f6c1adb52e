"""The ingress's view of the draining flag (`POST /admin/v1/drain`), which the admin
deployment holds.

A request is never admitted on a reading of the flag older than `period_s` (sent more than
that before the request arrived). Reading it takes a round trip through the admin replica to
the stats registry (about 5 ms on 2 cores), so a request that found the reading stale used to
wait for that round trip before its engine call: on sequential requests a third of a second
apart, every other one paid it in its time to first token. Now a reading older than
`prefetch_s` is refreshed in the background while it can still be used; under steady traffic
no request waits, and only a request after a quiet spell longer than `period_s` reads the flag
itself.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

PERIOD_S = 0.5
# A reading this old is refreshed in the background, ahead of `PERIOD_S`.
PREFETCH_S = 0.25
# The admin deployment answers within this, or the last answer stands.
TIMEOUT_S = 1.0


class DrainGate:
    def __init__(
        self,
        read: Callable[[], Awaitable[bool]],
        period_s: float = PERIOD_S,
        prefetch_s: float = PREFETCH_S,
        timeout_s: float = TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._clock = clock
        self.period_s = period_s
        self.prefetch_s = prefetch_s
        self.timeout_s = timeout_s
        self.draining = False
        # When the reading `draining` holds was sent (a failed one counts: the last answer
        # stands until the next period).
        self._read_at = float("-inf")
        self._refresh: asyncio.Task | None = None

    async def is_draining(self) -> bool:
        age = self._clock() - self._read_at
        if age > self.period_s:
            # Shielded: a request cancelled while it waits leaves the reading to the others.
            await asyncio.shield(self._start_refresh())
        elif age > self.prefetch_s:
            self._start_refresh()
        return self.draining

    def _start_refresh(self) -> asyncio.Task:
        if self._refresh is None:
            # NOTE: in an empty context, not the request's: Serve cancels the handle calls
            # made in a request's context when its client leaves.
            self._refresh = asyncio.get_running_loop().create_task(
                self._refresh_once(), context=contextvars.Context()
            )
        return self._refresh

    async def _refresh_once(self) -> None:
        sent_at = self._clock()
        try:
            self.draining = bool(await asyncio.wait_for(self._read(), self.timeout_s))
        except Exception as exc:  # noqa: BLE001 (admin replica restarting: keep the last)
            logger.info("draining flag unavailable (%s)", type(exc).__name__)
        finally:
            self._read_at = sent_at
            self._refresh = None
