"""The engine step: schedule -> execute (forward, the grammar masks filling meanwhile on
their own thread, then sample) -> postprocess.

Not thread-safe: one thread drives `step`; other threads talk to it through the caller's
queue (the Serve engine deployment owns that loop).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from actors.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from actors.deadlines import (
    CostModel,
    DeadlineConfig,
    DeadlineTracker,
    veto_hopeless,
)
from actors.detokenizer import IncrementalDetokenizer
from actors.executor import ExecutorError, make_executor, ranks_on_gpu
from actors.grammar_state import MaskFiller
from actors.kv_cache import BlockManager
from actors.messages import NewSeqData, ScheduledItem, StepInput, StepOutput, TokenLogprobs
from actors.outputs import CompletionDelta, RequestOutput
from actors.request import FinishReason, Sequence
from actors.sampler import NO_TOKEN
from actors.sampling_params import SamplingParams
from actors.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from actors.spec_decode import Backoff, Proposer, SpeculativeConfig, make_proposer
from actors.stop_checker import check_stop

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    request_id: str
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    pending: dict[int, CompletionDelta] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def take_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        """The whole prompt's logprobs, once, as soon as sample 0 has them all (before any
        sample is drawn: the prompt is computed first); index 0 has none."""
        seq0 = self.seqs[0]
        if self.prompt_logprobs_sent or seq0.params.prompt_logprobs is None:
            return None
        if seq0.wants_prompt_logprobs:
            return None
        self.prompt_logprobs_sent = True
        return [None, *seq0.prompt_logprobs]


class EngineCore:
    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        cache_config: CacheConfig | None = None,
        parallel_config: ParallelConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        seed: int = 0,
        deadline_config: DeadlineConfig | None = None,
        speculative_config: SpeculativeConfig | dict | None = None,
        step_delay_s: float = 0.0,
    ):
        if step_delay_s < 0:
            raise ValueError(f"step_delay_s must be >= 0, got {step_delay_s}")
        # Fault injection for tests and benchmarks: every step takes this much longer (a slow
        # model without a slow machine; keep 0).
        self.step_delay_s = step_delay_s
        self.model_config = model_config
        self.speculative_config = SpeculativeConfig.from_dict(speculative_config)
        self.deadline_config = deadline_config or DeadlineConfig(None, None)
        parallel_config = parallel_config or ParallelConfig()
        self.cache_config = (cache_config or CacheConfig()).settled(ranks_on_gpu(parallel_config))
        self.scheduler_config = scheduler_config or SchedulerConfig()
        self.tokenizer = tokenizer
        self.executor = make_executor(
            model_config,
            self.cache_config,
            parallel_config,
            seed,
            self.speculative_config,
        )
        try:
            num_blocks = self._init_kv_cache()
        except BaseException:
            self.executor.shutdown()  # its ranks and placement group, not left to the driver
            raise
        self.block_manager = BlockManager(
            num_blocks, self.cache_config.block_size, self.cache_config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager)
        self.requests: dict[str, _RequestState] = {}
        self._new_seqs: list[NewSeqData] = []
        self._finished_seq_ids: list[str] = []
        self._aborted_outputs: list[RequestOutput] = []
        self.num_steps = 0
        self.num_requests = 0
        self.cost = CostModel()
        # Called with each sequence's queue time (arrival to first scheduled step).
        self.on_queue_time: Callable[[float], None] | None = None
        # (proposer, proposed, accepted) per verified draft: the server's speculation metrics.
        self.on_draft_verified: Callable[[str, int, int], None] | None = None
        self.deadlines = DeadlineTracker()
        spec = self.speculative_config
        self.num_speculative_tokens = spec.num_speculative_tokens if spec else 0
        self.proposer: Proposer | None = make_proposer(spec, self.executor) if spec else None
        # Proposed and accepted draft tokens, and verifying steps' sequences, since start.
        self.spec_counts = {"spec_proposed_tokens": 0, "spec_accepted_tokens": 0, "spec_drafts": 0}
        # One mask row per sampled position a step can have, registered once on every rank.
        mask_rows = self.scheduler_config.max_num_seqs * (1 + self.num_speculative_tokens)
        try:
            self.executor.register_vocab_mask_buffer(mask_rows)
        except BaseException:
            self.executor.shutdown()
            raise
        self.masks = MaskFiller(model_config.vocab_size, mask_rows)
        # Set once a worker failed: the engine then refuses work and reports unhealthy.
        self.dead: str | None = None

    def _init_kv_cache(self) -> int:
        # More blocks than a full batch of longest sequences (twice, for the prefix cache)
        # would only cost memory.
        per_seq = -(-self.model_config.max_model_len // self.cache_config.block_size)
        num_blocks = min(
            self.executor.determine_num_blocks(), 2 * per_seq * self.scheduler_config.max_num_seqs
        )
        if self.cache_config.num_blocks is not None:
            num_blocks = self.cache_config.num_blocks
        self.executor.init_kv_cache(num_blocks)
        return num_blocks

    # ------------------------------------------------------------------ requests
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[0]!r} is outside the vocabulary [0, {vocab})")
        limit = self.model_config.max_model_len
        if len(prompt_token_ids) >= limit:
            raise ValueError(
                f"prompt: {len(prompt_token_ids)} tokens leave no room under max_model_len={limit}"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        constraints: list[object] | None = None,
        awaiting_constraint: bool = False,
        timeout_s: float | None = None,
        cache_namespace: str = "",
    ) -> None:
        """Queue a request. With `awaiting_constraint`, prefill may start before the grammar
        is ready; `set_constraints` releases the first sample. Prefix-cache blocks are shared
        only with requests of the same `cache_namespace`."""
        if self.dead is not None:
            raise ExecutorError(f"engine is not running: {self.dead}")
        if request_id in self.requests:
            raise ValueError(f"request_id: {request_id!r} is already running")
        self.validate_prompt(prompt_token_ids)
        longest = min(len(prompt_token_ids) + params.max_tokens, self.model_config.max_model_len)
        needed = self.block_manager.blocks_needed(longest)
        if needed > self.block_manager.num_blocks:
            # It could never be scheduled: refuse it instead of letting it wait forever.
            raise ValueError(
                f"max_tokens: prompt ({len(prompt_token_ids)}) plus max_tokens "
                f"({params.max_tokens}) needs {needed} KV blocks; the cache has "
                f"{self.block_manager.num_blocks}"
            )
        self._veto_hopeless(len(prompt_token_ids), timeout_s)
        if timeout_s is None:
            # The server's own bound ends the request (`timeout`); it never vetoes it.
            timeout_s = self.deadline_config.default_timeout_s
        seqs: list[Sequence] = []
        for i in range(params.n):
            seq = Sequence(
                seq_id=f"{request_id}#{i}",
                request_id=request_id,
                index=i,
                token_ids=list(prompt_token_ids),
                num_prompt_tokens=len(prompt_token_ids),
                params=params,
                priority=priority,
                leader=seqs[0] if seqs else None,
                constraint=constraints[i] if constraints else None,
                awaiting_constraint=awaiting_constraint,
                cache_namespace=cache_namespace,
            )
            seqs.append(seq)
            seed = params.seed
            if seed is not None and params.n > 1:
                seed = hash((seed, i)) & 0x7FFF_FFFF_FFFF_FFFF
            self._new_seqs.append(NewSeqData(seq.seq_id, params, list(prompt_token_ids), seed))
            self.scheduler.add(seq)
        detoks = [
            IncrementalDetokenizer(self.tokenizer, len(prompt_token_ids), params) for _ in seqs
        ]
        self.requests[request_id] = _RequestState(request_id, seqs, detoks)
        self.deadlines.add(request_id, timeout_s, self.deadline_config.max_queue_s)
        self.num_requests += 1

    def _veto_hopeless(self, num_prompt_tokens: int, timeout_s: float | None) -> None:
        """Refuse before prefill what the measured cost model says cannot make its deadline
        (the client's, or the server's bound on queue time)."""
        if timeout_s is None and self.deadline_config.max_queue_s is None:
            return  # nothing to check: skip summing the queue (O(queue) per request)
        ahead = sum(s.num_uncomputed_tokens for s in self.scheduler.waiting)
        ahead += sum(s.num_uncomputed_tokens - 1 for s in self.scheduler.running)
        veto_hopeless(self.cost, self.deadline_config, ahead, num_prompt_tokens, timeout_s)

    def set_constraints(self, request_id: str, constraints: list[object]) -> None:
        now = time.monotonic()
        for seq in self._seqs_of(request_id):
            seq.constraint = constraints[seq.index]
            seq.awaiting_constraint = False
            seq.constraint_time = now - seq.arrival_time

    def abort(
        self,
        request_id: str,
        reason: FinishReason = FinishReason.ABORT,
        error: str | None = None,
        error_code: str | None = None,
        stop_reason: str | None = None,
    ) -> None:
        """Stop a request; its blocks are free before the next step. Unknown ids: no-op."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        self.deadlines.discard(request_id)
        self._aborted_outputs.append(self._end(state, reason, error, error_code, stop_reason))

    def _end(
        self,
        state: _RequestState,
        reason: FinishReason,
        error: str | None = None,
        error_code: str | None = None,
        stop_reason: str | None = None,
    ) -> RequestOutput:
        deltas = []
        for seq, detok in zip(state.seqs, state.detokenizers, strict=True):
            if not seq.is_finished:
                self._finish(seq, reason, stop_reason)
                text = detok.take_delta(True)
                deltas.append(CompletionDelta(seq.index, [], text, None, reason, stop_reason))
        seq0 = state.seqs[0]
        return RequestOutput(
            state.request_id,
            seq0.prompt_token_ids,
            deltas,
            seq0.num_cached_tokens or 0,
            True,
            error=error,
            error_code=error_code,
        )

    def hold(self, request_id: str) -> None:
        for seq in self._seqs_of(request_id):
            self.scheduler.hold(seq.seq_id)

    def resume(self, request_id: str) -> None:
        for seq in self._seqs_of(request_id):
            self.scheduler.resume(seq.seq_id)

    def _seqs_of(self, request_id: str) -> list[Sequence]:
        state = self.requests.get(request_id)
        return [s for s in state.seqs if not s.is_finished] if state else []

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._aborted_outputs)

    # ---------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        outputs = self._step()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return outputs

    def _step(self) -> list[RequestOutput]:
        self._expire_deadlines()
        outputs, self._aborted_outputs = self._aborted_outputs, []
        if self.proposer is not None:
            try:
                self._propose()
            except ExecutorError as exc:
                logger.error("drafting failed; failing %d requests: %s", len(self.requests), exc)
                return outputs + self.fail_all(str(exc))
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        step_input = self._build_step_input(sched)
        started = time.perf_counter()
        sampled = [s for s in sched.scheduled if s.will_sample]
        masks = self.masks.start([s.seq.constraint for s in sampled], [s.draft for s in sampled])
        try:
            result = self.executor.execute(step_input, masks)
        except ExecutorError as exc:
            logger.error("engine step failed; failing %d requests: %s", len(self.requests), exc)
            return outputs + self.fail_all(str(exc))
        self.num_steps += 1
        self.cost.observe(time.perf_counter() - started, sched.num_batched_tokens)
        self.scheduler.on_step_done(sched)
        return outputs + self._postprocess(sched, result)

    def _propose(self) -> None:
        """A draft for each running sequence that may speculate this step (see
        `_speculation_room`); the scheduler trims it to the step's budget and free blocks."""
        assert self.proposer is not None
        rate = self.speculative_config.min_acceptance_rate
        asks = []
        for seq in self.scheduler.running:
            seq.draft_token_ids = []
            room = self._speculation_room(seq)
            if room > 0 and rate > 0:
                if seq.spec_backoff is None:
                    seq.spec_backoff = Backoff(rate)
                if not seq.spec_backoff.may_propose():
                    room = 0
            if room > 0:
                asks.append((seq, room))
        batch = getattr(self.proposer, "propose_batch", None)
        if batch is not None:
            drafts = batch(asks) if asks else []
        else:
            drafts = [self.proposer.propose(seq, room) for seq, room in asks]
        for (seq, _), draft in zip(asks, drafts, strict=True):
            seq.draft_token_ids = draft

    def _speculation_room(self, seq: Sequence) -> int:
        """How many tokens `seq` may have proposed now: 0 unless it is decoding with nothing
        else to compute, its grammar (if any) is still open, and committing the whole draft
        plus the bonus token stays within max_tokens and max_model_len."""
        p = seq.params
        if (
            seq.num_uncomputed_tokens != 1
            or seq.awaiting_constraint
            or seq.wants_prompt_logprobs
            or (seq.constraint is not None and seq.constraint.is_terminated())
        ):
            return 0
        left = min(
            p.max_tokens - seq.num_output_tokens, self.model_config.max_model_len - seq.num_tokens
        )
        return min(self.num_speculative_tokens, left - 1)

    def _build_step_input(self, sched: SchedulerOutput) -> StepInput:
        items = []
        now = time.monotonic()
        for s in sched.scheduled:
            if s.seq.queue_time is None:
                s.seq.queue_time = now - s.seq.arrival_time
                if self.on_queue_time is not None:
                    self.on_queue_time(s.seq.queue_time)
            start = s.seq.num_computed_tokens
            # Score the prompt only where this chunk reaches indices not reported yet.
            reaches_new = start + s.num_new_tokens > len(s.seq.prompt_logprobs)
            own = s.num_new_tokens - len(s.draft)
            items.append(
                ScheduledItem(
                    seq_id=s.seq.seq_id,
                    token_ids=s.seq.token_ids[start : start + own] + s.draft,
                    start_pos=start,
                    block_table=list(s.seq.block_table),
                    sample=s.will_sample,
                    prompt_logprobs=(
                        s.seq.params.prompt_logprobs
                        if s.seq.wants_prompt_logprobs and reaches_new
                        else None
                    ),
                    num_draft=len(s.draft),
                )
            )
        step = StepInput(items, self._new_seqs, self._finished_seq_ids)
        self._new_seqs, self._finished_seq_ids = [], []
        return step

    def _expire_deadlines(self) -> None:
        """A request past its deadline ends: `timeout` once it produced output, else it was
        never going to start in time (`deadline_unmeetable`), as is one still waiting to be
        scheduled after the server's maximum queue time. A request preempted after its first
        token is back in the queue, but has started: the queue time no longer applies."""
        for request_id in self.deadlines.expired_in_queue():
            state = self.requests.get(request_id)
            started = state is not None and any(
                s.num_computed_tokens or s.num_output_tokens for s in state.seqs
            )
            if state is not None and not started:
                message = "the request waited longer than the server's maximum queue time"
                self.abort(request_id, FinishReason.ERROR, message, "deadline_unmeetable")
        for request_id in self.deadlines.expired():
            state = self.requests.get(request_id)
            if state is None:
                continue
            if any(s.num_output_tokens for s in state.seqs):
                self.abort(request_id, FinishReason.TIMEOUT)
            else:
                message = "the deadline passed while the request was queued"
                self.abort(request_id, FinishReason.ERROR, message, "deadline_unmeetable")

    def _postprocess(self, sched: SchedulerOutput, result: StepOutput) -> list[RequestOutput]:
        self._collect_prompt_logprobs(sched, result)
        touched: dict[str, _RequestState] = {}
        sampled = [s for s in sched.scheduled if s.will_sample]
        for j, item in enumerate(sampled):
            seq = item.seq
            state = self.requests[seq.request_id]
            token = result.sampled_token_ids[j]
            logprobs = result.logprobs[j] if result.logprobs else None
            touched[seq.request_id] = state
            self._advance(state, seq, token, logprobs)
            if item.draft:
                self._commit_verified(state, item, j, result)
        outputs = []
        for state in touched.values():
            seq0 = state.seqs[0]
            outputs.append(
                RequestOutput(
                    state.request_id,
                    seq0.prompt_token_ids,
                    [state.pending.pop(i) for i in sorted(state.pending)],
                    seq0.num_cached_tokens or 0,
                    state.finished,
                    timeline=seq0.timeline if state.finished else None,
                    prompt_logprobs=state.take_prompt_logprobs(),
                )
            )
            if state.finished:
                self.requests.pop(state.request_id, None)
                self.deadlines.discard(state.request_id)
        return outputs

    def _commit_verified(
        self, state: _RequestState, item: ScheduledSeq, j: int, result: StepOutput
    ) -> None:
        """The rest of what verifying `item`'s draft committed, token by token as ordinary
        decode would have: each accepted draft token's KV counts as computed just before the
        next token lands (so the prefix cache hashes only committed tokens), a stop cuts the
        run there, and the blocks taken for rejected positions go back."""
        seq = item.seq
        more = result.more_token_ids.get(j, [])
        more_logprobs = result.more_logprobs.get(j)
        counts = self.spec_counts
        counts["spec_drafts"] += 1
        counts["spec_proposed_tokens"] += len(item.draft)
        # All but the last committed token are accepted draft tokens; the last is the target's.
        counts["spec_accepted_tokens"] += len(more)
        if seq.spec_backoff is not None:
            seq.spec_backoff.record(len(item.draft), len(more))
        if self.on_draft_verified is not None:
            self.on_draft_verified(self.proposer.name, len(item.draft), len(more))
        for i, token in enumerate(more):
            if seq.is_finished:
                break
            self.scheduler.commit_draft_token(seq)
            self._advance(state, seq, token, more_logprobs[i] if more_logprobs else None)
        self.scheduler.drop_rejected(seq)

    @staticmethod
    def _collect_prompt_logprobs(sched: SchedulerOutput, result: StepOutput) -> None:
        """Append each chunk's prompt logprobs to its sequence, skipping indices it already
        has (a prefill recomputed after preemption scores them again)."""
        if not result.prompt_logprobs:
            return
        seqs = {s.seq.seq_id: s.seq for s in sched.scheduled}
        for chunk in result.prompt_logprobs:
            seq = seqs[chunk.seq_id]
            skip = len(seq.prompt_logprobs) + 1 - chunk.first_index
            if skip < 0:
                raise RuntimeError(f"prompt logprobs of {chunk.seq_id} skipped an index")
            seq.prompt_logprobs.extend(chunk.entries[skip:])

    def _advance(self, state: _RequestState, seq: Sequence, token: int, logprobs) -> None:
        detok = state.detokenizers[seq.index]
        if token == NO_TOKEN:
            # The constraint admits nothing more: the grammar's own end.
            reason, stop = FinishReason.STOP, "grammar_end"
            new_tokens: list[int] = []
        else:
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic() - seq.arrival_time
            if seq.constraint is not None:
                seq.constraint.accept(token)
            new_tokens = [token]
            reason, stop = check_stop(seq, token, self.model_config, detok)
        if reason is not None:
            self._finish(seq, reason, stop)
        delta = state.pending.setdefault(seq.index, CompletionDelta(seq.index, [], ""))
        delta.token_ids.extend(new_tokens)
        delta.text += detok.take_delta(final=reason is not None)
        if logprobs is not None:
            delta.logprobs = (delta.logprobs or []) + [logprobs]
        delta.finish_reason, delta.stop_reason = reason, stop

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every live request with an error and refuse new work from now on."""
        self.dead = message
        outputs = [
            self._end(state, FinishReason.ERROR, message, "engine_lost")
            for state in self.requests.values()
        ]
        self.requests.clear()
        self.deadlines.deadlines.clear()
        return outputs

    def is_healthy(self) -> bool:
        return self.dead is None and self.executor.is_healthy()

    def _finish(self, seq: Sequence, reason: FinishReason, stop: str | int | None) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop
        self.scheduler.finish(seq)
        self._finished_seq_ids.append(seq.seq_id)

    # ---------------------------------------------------------------- lifecycle
    def stats(self) -> dict[str, int]:
        return {
            **self.scheduler.stats(),
            **self.spec_counts,
            "live_requests": len(self.requests),
            "requests_total": self.num_requests,
            "steps_total": self.num_steps,
        }

    def shutdown(self) -> None:
        self.masks.close()
        self.executor.shutdown()
