"""Continuous batching: one token budget per step shared by decodes and prefill chunks.

Each sequence simply has tokens not yet computed: one after a sample (decode), many for a
prompt (prefill, chunked under the budget). Running sequences are served first, in priority
order; when blocks run out the lowest-priority sequence is preempted (held ones first) and
recomputed later. Waiting sequences are admitted FCFS (priority hook) while room remains.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from actors.config import SchedulerConfig
from actors.kv_cache import BlockManager
from actors.request import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    # Positions this step computes: the sequence's own tokens, then `draft`.
    num_new_tokens: int
    # Proposed tokens verified after the sequence's last token (speculation; else empty).
    draft: list[int] = field(default_factory=list)
    # The step computes up to the last token, so its logits give the next one. Fixed at
    # scheduling time: computed-token counts move on when the step is done.
    will_sample: bool = field(init=False)

    def __post_init__(self) -> None:
        own = self.num_new_tokens - len(self.draft)
        self.will_sample = self.seq.num_computed_tokens + own == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []  # kept sorted by sort_key
        self.running: list[Sequence] = []  # kept sorted by sort_key
        self.held: dict[str, Sequence] = {}
        self.seqs: dict[str, Sequence] = {}
        self.num_preemptions = 0

    # ----------------------------------------------------------------- queue changes
    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs:
            raise ValueError(f"sequence {seq.seq_id!r} is already scheduled")
        self.seqs[seq.seq_id] = seq
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def hold(self, seq_id: str) -> bool:
        """Stop scheduling `seq_id`, keeping its KV. Returns False when unknown."""
        seq = self.seqs.get(seq_id)
        if seq is None or seq.status is SequenceStatus.HELD:
            return seq is not None
        self._remove_from_queue(seq)
        seq.status = SequenceStatus.HELD
        self.held[seq_id] = seq
        return True

    def resume(self, seq_id: str) -> bool:
        seq = self.held.pop(seq_id, None)
        if seq is None:
            return False
        if seq.block_table:
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
        else:
            seq.status = SequenceStatus.WAITING
            bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)
        return True

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence for good (finished or aborted) and free its blocks."""
        if self.seqs.pop(seq.seq_id, None) is None:
            return
        self._remove_from_queue(seq)
        self.held.pop(seq.seq_id, None)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED

    def _remove_from_queue(self, seq: Sequence) -> None:
        queue = {SequenceStatus.WAITING: self.waiting, SequenceStatus.RUNNING: self.running}
        queue_list = queue.get(seq.status)
        if queue_list is not None and seq in queue_list:
            queue_list.remove(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.seqs)

    # ----------------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        i = 0
        # NOTE: `resume` can leave more than max_num_seqs running; the batch stays capped.
        while (
            i < len(self.running) and budget > 0 and len(out.scheduled) < self.config.max_num_seqs
        ):
            seq = self.running[i]
            num_new = min(seq.num_schedulable_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            # A draft takes what the budget and free blocks leave; it never preempts anyone.
            draft = seq.draft_token_ids[: budget - num_new] if num_new == 1 else []
            if draft and not self.block_manager.allocate(seq, num_new + len(draft)):
                draft = []
            while not self.block_manager.allocate(seq, num_new):
                victim = self._pick_victim(exclude=scheduled_ids)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                num_new += len(draft)
                out.scheduled.append(ScheduledSeq(seq, num_new, draft))
                scheduled_ids.add(seq.seq_id)
                budget -= num_new
                i += 1
        if not out.preempted:
            budget = self._admit_waiting(out, budget)
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        blocked: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not seq.may_start:
                blocked.append(self.waiting.pop(0))
                continue
            # A prefill that must report prompt logprobs recomputes any cached prefix.
            reuse = not seq.block_table and not seq.wants_prompt_logprobs
            hits = self.block_manager.match_prefix(seq) if reuse else []
            num_cached = len(hits) * self.block_manager.block_size
            wanted = seq.num_schedulable_tokens - num_cached
            if wanted <= 0:
                # Only the sampling step is left and its constraint is not ready yet.
                blocked.append(self.waiting.pop(0))
                continue
            num_new = min(wanted, budget)
            if num_new < wanted and not self.config.enable_chunked_prefill:
                break
            if not self._allocate_reclaiming_held(seq, num_new, hits, out):
                break
            self.waiting.pop(0)
            seq.num_computed_tokens += num_cached
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        for seq in blocked:
            bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)
        return budget

    def _allocate_reclaiming_held(
        self, seq: Sequence, num_new: int, hits: list[int], out: SchedulerOutput
    ) -> bool:
        """Held sequences give their blocks up before a waiting one is turned away."""
        while not self.block_manager.allocate(seq, num_new, hits):
            victim = next((s for s in self.held.values() if s.block_table), None)
            if victim is None:
                return False
            # Freed hit blocks stay cached (ref count 0), so `hits` remains valid.
            self._preempt(victim)
            out.preempted.append(victim)
        return True

    def _pick_victim(self, exclude: set[str]) -> Sequence:
        for seq in self.held.values():
            if seq.block_table:
                return seq
        candidates = [s for s in self.running if s.seq_id not in exclude]
        return candidates[-1]

    def _preempt(self, seq: Sequence) -> None:
        """Free the KV of `seq`; it recomputes from scratch when scheduled again."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            seq.status = SequenceStatus.WAITING
            bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def on_step_done(self, out: SchedulerOutput) -> None:
        """Advance computed-token counts and publish newly full blocks to the prefix cache.
        A verified draft's positions count only once accepted (`commit_draft_token`)."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens - len(item.draft)
            self.block_manager.cache_full_blocks(item.seq)

    def commit_draft_token(self, seq: Sequence) -> None:
        """One more accepted draft token counts as computed (its KV was written by the
        verifying step); call it once that token is in `seq.token_ids`."""
        seq.num_computed_tokens += 1
        self.block_manager.cache_full_blocks(seq)

    def drop_rejected(self, seq: Sequence) -> None:
        """After a verifying step: the blocks taken only for rejected positions go back, so
        the block table and ref counts are as if those positions were never written."""
        if seq.is_finished:
            return
        self.block_manager.truncate(seq, seq.num_computed_tokens)

    def stats(self) -> dict[str, int]:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "held": len(self.held),
            "kv_blocks_total": self.block_manager.num_blocks,
            "kv_blocks_used": self.block_manager.num_used_blocks,
            "num_preemptions": self.num_preemptions,
        }
