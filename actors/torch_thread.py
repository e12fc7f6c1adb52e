"""One thread for all of an owner's torch work.

OpenMP gives every thread that runs torch ops a team of worker threads of its own. A model
loaded on one thread and stepped on another leaves the first team idle beside the second,
and on 2 cores the steps then ran ~20% slower (measured on the `bench` checkpoint: 380 vs
~490 tok/s). Owners whose callers arrive on a thread they do not choose (a Ray Data actor
calls `__init__` on its main thread and `__call__` on a worker thread) route both through
one `TorchThread`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class TorchThread:
    def __init__(self, name: str = "torch"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """`fn(*args, **kwargs)` on the thread; its result, or its exception raised here."""
        return self._pool.submit(fn, *args, **kwargs).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)
