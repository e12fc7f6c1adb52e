"""How a `serve-app batch` driver takes SIGINT (Ctrl-C) and SIGTERM.

The first signal asks the job to stop: no new rows, rows already running get the drain
timeout, what finished is committed, a summary is printed, and the command exits 130 (SIGINT)
or 143 (SIGTERM). A second signal exits at once: every result file on disk is whole, so
nothing committed is lost, and `--resume` runs the rest. No traceback either way.

Handlers can only be set from the main thread; elsewhere (a job run from a worker thread)
the process's own handling stays, and the job stops only when it ends.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def exit_status(signum: int) -> int:
    return 128 + signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


class StopSignals:
    def __init__(self, drain_timeout_s: float):
        self.drain_timeout_s = drain_timeout_s
        self.signum: int | None = None
        # Set by the first signal: wakes a driver waiting on it at once.
        self.stopping = threading.Event()
        self._previous: dict[int, Any] = {}

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum is not None else None

    def __enter__(self) -> StopSignals:
        self.install()
        return self

    def install(self) -> None:
        """Set the handlers (again: `ray.init` sets a SIGTERM handler of its own)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in SIGNALS:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            self.stopping.set()
            print(
                f"\nbatch: {name}: stopping; no new rows, rows already running get up to "
                f"{self.drain_timeout_s:g}s, then the rest is left for --resume "
                "(signal again to quit at once)",
                file=sys.stderr,
                flush=True,
            )
            return
        print(
            f"\nbatch: {name} again: quitting now; the results on disk are whole and kept, "
            "--resume runs the rest",
            file=sys.stderr,
            flush=True,
        )
        os._exit(exit_status(self.signum))
