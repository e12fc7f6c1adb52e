"""Sequence state: one sample stream of a request, as the scheduler and engine see it."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from actors.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Kept (its KV too, unless preempted), not scheduled: the consumer is not reading.
    HELD = "held"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    TIMEOUT = "timeout"
    # The engine (a worker) failed; the request cannot continue.
    ERROR = "error"


@dataclass(eq=False)
class Sequence:
    seq_id: str
    request_id: str
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    priority: int = 0
    arrival_order: int = field(default_factory=lambda: next(_arrival_counter))
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache at first admission (reported once).
    num_cached_tokens: int | None = None
    block_table: list[int] = field(default_factory=list)
    # Hash chain of this sequence's full blocks, filled as blocks become full.
    block_hashes: list[bytes] = field(default_factory=list)
    # Prefix-cache namespace (opaque; the service derives it from the tenant): cached blocks
    # are shared only between sequences of the same namespace.
    cache_namespace: str = ""
    # Another sample of the same request whose prefill this one waits for (n > 1).
    leader: Sequence | None = None
    # Per-request constraint (grammar matcher) consulted before sampling; see grammar_state.
    constraint: Any = None
    # The constraint is still compiling: prefill may run, but not up to the first sample.
    awaiting_constraint: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    # Prompt logprobs gathered so far (TokenLogprobs of prompt indices 1, 2, ...): sample 0
    # collects them when the params ask; a recomputed prefill does not report them twice.
    prompt_logprobs: list[Any] = field(default_factory=list)
    # Seconds from arrival to the first step that computed any of its tokens.
    queue_time: float | None = None
    # Seconds from arrival until its grammar was attached, and until its first token.
    constraint_time: float | None = None
    first_token_time: float | None = None
    # Speculation: this step's proposed tokens (set before scheduling, verified in the step),
    # and the proposer's own per-sequence state.
    draft_token_ids: list[int] = field(default_factory=list)
    proposer_state: Any = None
    spec_backoff: Any = None  # spec_decode.Backoff, made at the sequence's first proposal

    @property
    def timeline(self) -> dict[str, float | None]:
        """When this sample was first scheduled (prefill began), got its grammar, and
        produced its first token, in seconds from arrival; `arrived_at`, the arrival itself
        on this process's `time.monotonic` clock."""
        return {
            "arrived_at": self.arrival_time,
            "scheduled_s": self.queue_time,
            "grammar_ready_s": self.constraint_time,
            "first_token_s": self.first_token_time,
        }

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_schedulable_tokens(self) -> int:
        """Tokens that may be computed now: all but the last while a constraint compiles."""
        return self.num_uncomputed_tokens - (1 if self.awaiting_constraint else 0)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are still to be computed: its prefill must not reuse cached
        blocks (they hold KV, not logits), and its chunks ask the runner to score them."""
        return (
            self.params.prompt_logprobs is not None
            and self.index == 0
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def may_start(self) -> bool:
        """A sample waits for its leader's prompt blocks so it can share them."""
        leader = self.leader
        return leader is None or leader.is_finished or leader.is_prefill_done

    @property
    def sort_key(self) -> tuple[int, int]:
        # Lower priority value first, then arrival: FCFS with a priority hook.
        return (self.priority, self.arrival_order)
