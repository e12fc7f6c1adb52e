"""A generation running in this process, and the stream readers that follow it.

A reader's queue is bounded: one that falls `limit` events behind is detached (no more
deltas, then the final resource), so a stalled client never holds a generation back.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from serve_app.resources.admitted import AdmittedGeneration
from serve_app.store.base import GenerationRecord

# Output events a stream reader may fall behind by before it is detached.
SUBSCRIBER_LIMIT = 256


@dataclass(frozen=True)
class Event:
    kind: str  # "delta" | "finished"
    data: dict[str, Any]


class Subscriber:
    """A stream reader's bounded view of one generation's events."""

    def __init__(self, limit: int = SUBSCRIBER_LIMIT) -> None:
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.limit = limit
        self.is_detached = False

    def offer(self, event: Event) -> None:
        if self.is_detached:
            return
        if self.queue.qsize() >= self.limit:
            self.is_detached = True  # a stalled reader never holds the generation back
            return
        self.queue.put_nowait(event)

    def close(self, final: Event) -> None:
        self.queue.put_nowait(final)


class RunningGeneration:
    """A generation running in this process."""

    def __init__(self, plan: AdmittedGeneration) -> None:
        self.plan = plan
        self.done: asyncio.Future[GenerationRecord] = asyncio.get_running_loop().create_future()
        self.subscribers: list[Subscriber] = []
        self.is_cancel_requested = False
        self.stream: Any = None

    def subscribe(self) -> Subscriber:
        sub = Subscriber()
        self.subscribers.append(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        if sub in self.subscribers:
            self.subscribers.remove(sub)

    def request_cancel(self) -> None:
        self.is_cancel_requested = True
        if self.stream is not None:
            self.stream.cancel()

    def publish(self, event: Event) -> None:
        for sub in self.subscribers:
            sub.offer(event)

    def finish(self, record: GenerationRecord, resource: dict[str, Any]) -> None:
        if not self.done.done():
            self.done.set_result(record)
        for sub in self.subscribers:
            sub.close(Event("finished", resource))
