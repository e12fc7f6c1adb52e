"""One thread for all of an owner's torch work.

OpenMP gives every thread that runs torch ops a team of worker threads of its own. A model
loaded on one thread and stepped on another leaves the first team idle beside the second,
and on 2 cores the steps then ran ~20% slower (measured on the `bench` checkpoint: 380 vs
~490 tok/s). Owners whose callers arrive on a thread they do not choose (a Ray Data actor
calls `__init__` on its main thread and `__call__` on a worker thread) route both through
one `TorchThread`.

`name_os_thread` gives the calling thread an OS-visible name (`top -H`, `/proc/PID/task/*/comm`);
OpenMP workers a named thread starts inherit it, so an engine's step threads can be told from
the serving path's when CPU is accounted per thread (`benchmarks/serving.py`).

`favour_step_thread` shortens the GIL switch interval of a process whose step thread shares
the GIL with other Python threads (Serve's loop and Ray's threads in an engine replica, Ray
Data's in a batch actor).

`normal_scheduling` puts the calling thread back on Linux's normal policy where its process
inherited `SCHED_BATCH` (a local Ray is started under it, `serve_app/ray_env.py`): the step
thread and the OpenMP team it starts then keep their cores against the serving path's threads,
which wait for a running thread's slice instead of preempting it when they wake.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# The step thread gives up the GIL around every torch op and must win it back from the other
# threads; at Python's default 5 ms interval it waits longer. Measured at 0.5 ms on 2 cores
# (`bench` checkpoint): a 16-stream server made 288 vs 268 tok/s (means of 4 and 5 runs), a
# 256-row batch job 462 vs 437 (2 runs each); single runs vary by about 15%.
STEP_THREAD_SWITCH_INTERVAL_S = 0.0005


# Thread-name prefix of every thread doing an engine's step work (the step thread, its OpenMP
# team, the grammar mask filler).
ENGINE_THREAD_PREFIX = "engine-"
_PR_SET_NAME = 15


def name_os_thread(name: str) -> None:
    """Name the calling thread for the OS (Linux: 15 bytes at most); elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # no libc to call: the name is only for operators
        pass


def normal_scheduling() -> None:
    """The calling thread on `SCHED_OTHER` if it runs `SCHED_BATCH`; elsewhere a no-op."""
    if not hasattr(os, "SCHED_BATCH"):
        return
    try:
        if os.sched_getscheduler(0) == os.SCHED_BATCH:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except OSError:  # a policy this thread may not leave: it keeps it
        pass


def favour_step_thread() -> None:
    sys.setswitchinterval(STEP_THREAD_SWITCH_INTERVAL_S)


class TorchThread:
    def __init__(self, name: str = "torch"):
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name, initializer=normal_scheduling
        )

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` on the thread; its result, or its exception raised here."""
        return self._pool.submit(fn, *args, **kwargs).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)
