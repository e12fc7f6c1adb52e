"""One request attempt's way out of the engine: its lifecycle phase and a bounded window of
outputs the consumer has not read yet.

Phases: queued -> running -> (held) -> finished, or cancelling -> released when the
consumer leaves first. Only the event loop touches an OutputStream; the step thread reaches
it through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from enum import StrEnum

from actors.outputs import RequestOutput


class Phase(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    # The consumer fell `capacity` outputs behind: not scheduled, KV kept.
    HELD = "held"
    FINISHED = "finished"
    # The consumer left before the end: the abort is on its way to the step thread.
    CANCELLING = "cancelling"
    # The engine confirmed the abort: its blocks are free, nothing more will arrive.
    RELEASED = "released"


class OutputStream:
    """A FIFO of RequestOutputs with a high-water mark.

    Pushing never blocks (the step thread must not wait on a slow reader). The step thread
    counts the window itself (`AsyncEngine`) and holds the request at `capacity` unread
    outputs, so however late the event loop delivers, the window never overshoots; `pop`
    reports when it drained to half so the caller can resume it.
    """

    def __init__(self, request_id: str, attempt: int, capacity: int):
        self.request_id = request_id
        self.attempt = attempt
        self.capacity = capacity
        self.phase = Phase.QUEUED
        self._items: deque[RequestOutput] = deque()
        self._ready = asyncio.Event()
        self.hold_timer: asyncio.TimerHandle | None = None
        # The reader's own transport stopped taking outputs (a client that stopped reading):
        # nothing is handed out until it resumes, except the end.
        self.reader_paused = False
        # The step thread's count of steps begun when the consumer left (CANCELLING).
        self.closed_at_step = 0

    @property
    def is_open(self) -> bool:
        return self.phase not in (Phase.FINISHED, Phase.CANCELLING, Phase.RELEASED)

    def push(self, out: RequestOutput) -> None:
        """Queue one output (the step thread decides holds: `AsyncEngine._count_window`)."""
        self._items.append(out)
        self._ready.set()
        if out.finished:
            self.phase = Phase.FINISHED
        elif self.phase is Phase.QUEUED:
            self.phase = Phase.RUNNING

    @property
    def unread(self) -> int:
        return len(self._items)

    @property
    def can_resume(self) -> bool:
        return (
            self.phase is Phase.HELD
            and not self.reader_paused
            and len(self._items) <= self.capacity // 2
        )

    def pause_reader(self, paused: bool) -> None:
        self.reader_paused = paused
        if not paused:
            self._ready.set()

    async def pop(self) -> tuple[RequestOutput, bool]:
        """The next output, and True when a held request may resume."""
        while not self._items or (self.reader_paused and not self._items[-1].finished):
            self._ready.clear()
            await self._ready.wait()
        out = self._items.popleft()
        return out, self.can_resume
