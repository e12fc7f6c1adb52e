"""Seeded kills for the crash tests of `serve-app batch`: real signals at named points.

`SERVE_APP_BATCH_TEST_KILL_AT=POINT:N:SIGNAL[,POINT:N:SIGNAL...]` (read by the driver, handed
to its engine actors) sends SIGNAL to the job's driver process the N-th time one process
reaches POINT:

- `call`: an engine call starts (before it adds any row to its engine)
- `write`: a result file is written under its temporary name, not yet renamed
- `commit`: a result file has been renamed into place
- `compact`: a merged file has landed, the files it replaces are still there

With SIGKILL an engine actor then kills itself as well, so the directory is left as a machine
that died at that point leaves it (at `write`: a temporary). Nothing here runs unless the
variable is set.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

KILL_AT_ENV = "SERVE_APP_BATCH_TEST_KILL_AT"
POINTS = ("call", "write", "commit", "compact")


@dataclass(frozen=True)
class KillPoint:
    point: str
    count: int
    signum: int
    driver_pid: int


def kill_points_from_env() -> tuple[KillPoint, ...]:
    spec = os.environ.get(KILL_AT_ENV, "")
    return tuple(_parse(item) for item in spec.split(",") if item.strip())


def _parse(item: str) -> KillPoint:
    try:
        point, count, name = item.strip().split(":")
        signum = int(signal.Signals[name])
        number = int(count)
    except (ValueError, KeyError):
        raise ValueError(f"{KILL_AT_ENV}: expected POINT:N:SIGNAL, got {item!r}") from None
    if point not in POINTS or number < 1:
        raise ValueError(f"{KILL_AT_ENV}: POINT is one of {', '.join(POINTS)} and N >= 1")
    return KillPoint(point, number, signum, os.getpid())


class FaultHook:
    """Counts the points one process passes; fires each kill point once."""

    def __init__(self, kills: tuple[KillPoint, ...] = ()):
        self.kills = kills
        self._seen: dict[str, int] = {}

    def reached(self, point: str) -> None:
        if not self.kills:
            return
        self._seen[point] = self._seen.get(point, 0) + 1
        for kill in self.kills:
            if kill.point == point and kill.count == self._seen[point]:
                os.kill(kill.driver_pid, kill.signum)
                if kill.signum == signal.SIGKILL and os.getpid() != kill.driver_pid:
                    os.kill(os.getpid(), signal.SIGKILL)
