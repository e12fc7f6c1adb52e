"""The job board of `serve-app batch`: one small actor between the driver and its engines.

Engines post what they finished and committed (every REPORT_INTERVAL_S, and at the start and
end of each call); the driver reads the totals for its progress display and posts a stop.
Each post returns the stop order. While an engine steps it does not wait for the answer (it
reads it at a later tick: a stop reaches it within about two intervals, and the step never
waits on the board); the post that starts a call is waited for, so no engine starts a call
after a stop without knowing. `JobBoard` is plain Python; the driver wraps it in `ray.remote`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

# How often an engine posts while it steps: the progress display's resolution and the delay
# before an engine sees a stop. One post is one small actor call.
REPORT_INTERVAL_S = 0.5


@dataclass
class Counts:
    """Rows and tokens; `committed_*` are on disk, the others finished in an engine."""

    num_finished: int = 0
    num_failed: int = 0
    completion_tokens: int = 0
    num_committed: int = 0
    committed_prompt_tokens: int = 0
    committed_completion_tokens: int = 0
    num_files: int = 0

    def add(self, other: Counts) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def take(self) -> Counts:
        """These counts, leaving zeros behind (what an engine has not posted yet)."""
        taken = Counts(**vars(self))
        for name in self.__dataclass_fields__:
            setattr(self, name, 0)
        return taken


@dataclass(frozen=True)
class Post:
    engine_id: str
    counts: Counts
    is_busy: bool  # inside a call: it may still commit rows


@dataclass(frozen=True)
class StopOrder:
    drain_timeout_s: float  # how long rows already running may go on


@dataclass(frozen=True)
class Snapshot:
    counts: Counts
    num_busy: int
    stop: StopOrder | None


class JobBoard:
    def __init__(self) -> None:
        self._counts = Counts()
        self._busy: set[str] = set()
        self._stop: StopOrder | None = None

    def post(self, post: Post) -> StopOrder | None:
        self._counts.add(post.counts)
        if post.is_busy:
            self._busy.add(post.engine_id)
        else:
            self._busy.discard(post.engine_id)
        return self._stop

    def request_stop(self, drain_timeout_s: float) -> None:
        if self._stop is None:
            self._stop = StopOrder(drain_timeout_s)

    def snapshot(self) -> Snapshot:
        return Snapshot(Counts(**vars(self._counts)), len(self._busy), self._stop)


@dataclass
class JobBoardClient:
    """An engine's side of the board: counts since the last post, posted at most every
    REPORT_INTERVAL_S without waiting for the answer (read at a later tick), or at once and
    waited for when forced; remembers a stop once seen (and when it saw it)."""

    board: Any  # the JobBoard actor's handle
    engine_id: str
    pending: Counts = field(default_factory=Counts)
    stop: StopOrder | None = None
    stop_seen_at: float | None = None  # time.monotonic()
    _last_post: float = 0.0
    _in_flight: Any = None  # the ObjectRef of a post not yet answered

    def post(self, *, is_busy: bool, force: bool = False) -> StopOrder | None:
        import ray

        if self._in_flight is not None and (force or ray.wait([self._in_flight], timeout=0)[0]):
            self._learn(self._answer(self._in_flight))
            self._in_flight = None
        if force:
            self._learn(self._answer(self._send(is_busy)))
        elif self._in_flight is None and time.monotonic() - self._last_post >= REPORT_INTERVAL_S:
            self._in_flight = self._send(is_busy)
        return self.stop

    def _send(self, is_busy: bool) -> Any:
        self._last_post = time.monotonic()
        return self.board.post.remote(Post(self.engine_id, self.pending.take(), is_busy))

    @staticmethod
    def _answer(ref: Any) -> StopOrder | None:
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError:  # the driver has gone: nothing more will be read
            return StopOrder(drain_timeout_s=0.0)

    def _learn(self, order: StopOrder | None) -> None:
        if order is not None and self.stop is None:
            self.stop, self.stop_seen_at = order, time.monotonic()
