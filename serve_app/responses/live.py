"""A stored response running in this process (`LiveResponse`): its numbered events so far,
which the readers in this process follow from memory, and how a batch of events is cut at
its terminal one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from serve_app.responses.admission import AdmittedResponse
from serve_app.responses.output import Event
from serve_app.responses.run import ResponseRun

TERMINAL_EVENTS = (
    "response.completed",
    "response.incomplete",
    "response.failed",
    "response.cancelled",
)


class LiveResponse:
    """A stored response running in this process: its numbered events so far."""

    def __init__(self, admitted: AdmittedResponse, base: Callable[..., dict[str, Any]]) -> None:
        loop = asyncio.get_running_loop()
        self.admitted = admitted
        self.base = base
        self.events: list[Event] = []
        # Set once the response is accepted (recorded; or its first output arrived), or
        # with the error that refused it before anything was stored.
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[dict[str, Any]] = loop.create_future()
        self.is_cancel_requested = False
        self.stream: Any = None
        self.run: ResponseRun | None = None
        self.num_flushed = 0
        self.num_writes = 0
        self.flushed_at = time.monotonic()
        self._changed: asyncio.Future[None] = loop.create_future()
        self.lock = asyncio.Lock()  # one record write at a time, in event order

    @property
    def id(self) -> str:
        return self.admitted.response_id

    def add(self, event: Event) -> Event:
        event["sequence_number"] = len(self.events)
        self.events.append(event)
        changed, self._changed = self._changed, asyncio.get_running_loop().create_future()
        changed.set_result(None)
        return event

    async def changed(self) -> None:
        # asyncio.wait: a reader that goes away never cancels the shared future.
        await asyncio.wait([self._changed])

    def request_cancel(self) -> None:
        self.is_cancel_requested = True
        if self.stream is not None:
            self.stream.cancel()

    def accept(self, error: BaseException | None = None) -> None:
        if not self.accepted.done():
            if error is None:
                self.accepted.set_result(None)
            else:
                self.accepted.set_exception(error)


async def follow_live_events(live: LiveResponse, index: int) -> AsyncIterator[list[Event]]:
    """Its events from `index`, every event ready at once as one batch, until the terminal."""
    while True:
        if index < len(live.events):
            batch, ended = until_terminal(live.events[index:])
            if ended:
                yield batch
                return
            index += len(batch)
            yield batch
            continue
        await live.changed()


def is_terminal(event: Event) -> bool:
    return event["type"] in TERMINAL_EVENTS


def until_terminal(events: list[Event]) -> tuple[list[Event], bool]:
    """`events` up to and including the first terminal one, and whether there was one."""
    for i, event in enumerate(events):
        if is_terminal(event):
            return events[: i + 1], True
    return events, False
