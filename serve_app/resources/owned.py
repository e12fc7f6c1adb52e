"""Work a resource owns outside the HTTP request that created it, for every family.

NOTE: Serve cancels a handler's task when its client disconnects, and the cancellation
reaches every handle call made in that request's context (even under `asyncio.shield`).
So a resource's run is a task started with an *empty* contextvars.Context: it is no child
of the request, and a disconnect never cancels it. Handlers only wait on futures.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any


class OwnedTasks:
    """The runs this process owns; each is kept referenced until it ends."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)
