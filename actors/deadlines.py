"""Client deadlines: a measured cost model to veto hopeless requests before prefill, and a
tracker that ends requests whose deadline passes while they wait or run."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


class RequestRejected(ValueError):
    """Refused at admission for a reason the client can act on (`code` names it)."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


@dataclass
class CostModel:
    """Step time ~ overhead + tokens x per-token cost, each an exponential moving average of
    measured steps: prefill-heavy steps teach the per-token cost, near-empty steps the
    overhead. Unmeasured values are zero, so a fresh engine vetoes nothing."""

    smoothing: float = 0.2
    seconds_per_token: float = 0.0
    seconds_per_step: float = 0.0
    # Steps with at least this many tokens measure the per-token cost; at most
    # `small_step_tokens`, the fixed overhead of a step.
    large_step_tokens: int = 64
    small_step_tokens: int = 8

    def observe(self, seconds: float, num_tokens: int) -> None:
        if num_tokens >= self.large_step_tokens:
            self.seconds_per_token = self._ema(self.seconds_per_token, seconds / num_tokens)
        elif num_tokens <= self.small_step_tokens:
            self.seconds_per_step = self._ema(self.seconds_per_step, seconds)

    def _ema(self, old: float, new: float) -> float:
        return new if old == 0.0 else old + self.smoothing * (new - old)

    def time_to_first_token(self, tokens_ahead: int, own_tokens: int) -> float:
        """Queue and own prefill at the measured rate, plus the step that samples."""
        return (tokens_ahead + own_tokens) * self.seconds_per_token + self.seconds_per_step


@dataclass(frozen=True)
class DeadlineConfig:
    """Server-side bounds that apply whatever the client asks."""

    # Total time of a request that names no deadline of its own (None: unbounded).
    default_timeout_s: float | None = 600.0
    # Longest wait before the first token; past it a still-queued request ends as
    # `deadline_unmeetable` (None: unbounded).
    max_queue_s: float | None = 60.0

    def __post_init__(self) -> None:
        for name in ("default_timeout_s", "max_queue_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}: must be > 0 or None, got {value}")


def veto_hopeless(
    cost: CostModel,
    config: DeadlineConfig,
    tokens_ahead: int,
    num_prompt_tokens: int,
    timeout_s: float | None,
) -> None:
    """Raise RequestRejected for a request the measured cost says cannot make its client's
    deadline (too short even when idle, or made hopeless by the queue) or would wait longer
    than the server's maximum queue time."""
    max_queue_s = config.max_queue_s
    if timeout_s is None and max_queue_s is None:
        return
    alone = cost.time_to_first_token(0, num_prompt_tokens)
    if timeout_s is not None and alone > timeout_s:
        raise RequestRejected(
            "deadline_too_short",
            f"timeout: {timeout_s:.3f}s is below the ~{alone:.3f}s this prompt needs "
            "even on an idle server",
        )
    estimate = cost.time_to_first_token(tokens_ahead, num_prompt_tokens)
    if timeout_s is not None and estimate > timeout_s:
        raise RequestRejected(
            "deadline_unmeetable",
            f"timeout: the queue ({tokens_ahead} tokens ahead) puts the first token at "
            f"~{estimate:.3f}s, past the {timeout_s:.3f}s deadline",
            retry_after_s=max(1.0, estimate - timeout_s),
        )
    wait = cost.time_to_first_token(tokens_ahead, 0)
    if max_queue_s is not None and wait > max_queue_s:
        raise RequestRejected(
            "deadline_unmeetable",
            f"the queue ({tokens_ahead} tokens ahead) would hold this request ~{wait:.3f}s, "
            f"past the server's maximum queue time of {max_queue_s:.3f}s",
            retry_after_s=max(1.0, wait - max_queue_s),
        )


@dataclass
class DeadlineTracker:
    deadlines: dict[str, float] = field(default_factory=dict)
    # When each request must have produced its first token by.
    queue_deadlines: dict[str, float] = field(default_factory=dict)

    def add(self, request_id: str, timeout_s: float | None, max_queue_s: float | None) -> None:
        now = time.monotonic()
        if timeout_s is not None:
            self.deadlines[request_id] = now + timeout_s
        if max_queue_s is not None:
            self.queue_deadlines[request_id] = now + max_queue_s

    def discard(self, request_id: str) -> None:
        self.deadlines.pop(request_id, None)
        self.queue_deadlines.pop(request_id, None)

    def expired(self) -> list[str]:
        return _pop_expired(self.deadlines)

    def expired_in_queue(self) -> list[str]:
        return _pop_expired(self.queue_deadlines)


def _pop_expired(deadlines: dict[str, float]) -> list[str]:
    if not deadlines:
        return []
    now = time.monotonic()
    gone = [rid for rid, deadline in deadlines.items() if deadline <= now]
    for rid in gone:
        del deadlines[rid]
    return gone
