"""Property-based scheduler test: random operations never leak, alias or starve blocks."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.config import SchedulerConfig
from actors.kv_cache import BlockManager
from actors.request import Sequence, SequenceStatus
from actors.scheduler import Scheduler
from tests.support.scheduler import make_seq

# ------------------------------------------------------------------ random operations

BLOCK_SIZE = 4
NUM_BLOCKS = 6
MAX_PROMPT = 14
MAX_OUTPUT = 8  # computed tokens stay under 21 <= NUM_BLOCKS * BLOCK_SIZE
# Prompts differ in their first token only: later blocks repeat content after other prefixes.
BASE_PROMPTS = [[50 + k, *range(101, 100 + MAX_PROMPT)] for k in range(3)]

add_op = st.tuples(
    st.just("add"),
    st.integers(1, MAX_PROMPT),
    st.integers(1, MAX_OUTPUT),
    st.integers(0, 2),  # priority
    st.integers(1, 3),  # n
    st.integers(0, len(BASE_PROMPTS) - 1),
)
ops_strategy = st.lists(
    st.one_of(
        add_op,
        st.tuples(st.just("step"), st.integers(1, 2)),
        *(st.tuples(st.just(kind), st.integers(0, 99)) for kind in ("hold", "resume", "finish")),
    ),
    min_size=20,
    max_size=60,
)


class Harness:
    """Drives a small scheduler and checks its invariants, with a shadow of the KV content."""

    def __init__(self) -> None:
        self.config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8)
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.sched = Scheduler(self.config, self.bm)
        self.seqs: list[Sequence] = []
        self.aborted: set[str] = set()
        # (block, offset) -> what the KV written there last depends on: the token and all
        # tokens before it.
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}

    def add(self, prompt_len: int, max_tokens: int, priority: int, n: int, base: int) -> None:
        prompt = BASE_PROMPTS[base][:prompt_len]
        name = f"r{len(self.seqs)}"
        leader = make_seq(prompt, max_tokens, priority, name=name)
        group = [leader] + [
            make_seq(prompt, max_tokens, priority, leader=leader, index=i) for i in range(1, n)
        ]
        for seq in group:
            self.sched.add(seq)
        self.seqs.extend(group)

    def step(self) -> None:
        out = self.sched.schedule()
        assert len(out.scheduled) <= self.config.max_num_seqs
        assert out.scheduled or not self.sched.running  # never idle with work running
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
        for item in out.scheduled:
            seq = item.seq
            assert item.num_new_tokens >= 1 and seq.status is SequenceStatus.RUNNING
            start = seq.num_computed_tokens
            for pos in range(start, start + item.num_new_tokens):
                block = seq.block_table[pos // BLOCK_SIZE]
                # Writing into a block another sequence reads, or the cache serves, corrupts it.
                assert self.bm.ref_counts[block] == 1 and self.bm.block_hash[block] is None
                self.kv[block, pos % BLOCK_SIZE] = tuple(seq.token_ids[: pos + 1])
        self.sched.on_step_done(out)
        for item in out.scheduled:
            seq = item.seq
            if item.will_sample:
                seq.token_ids.append(200 + seq.num_tokens % 5)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self.sched.finish(seq)

    def pick(self, kind: str, i: int) -> Sequence | None:
        # Most holds and resumes target sequences they change; the rest pick any.
        targets = {"hold": self.sched.running, "resume": list(self.sched.held.values())}
        pool = targets.get(kind) if i % 4 else None
        pool = pool or self.seqs
        return pool[i % len(pool)] if pool else None

    def apply(self, op: tuple) -> None:
        kind, *args = op
        if kind == "add":
            self.add(*args)
        elif kind == "step":
            for _ in range(args[0]):
                self.step()
                self.check()
        elif (seq := self.pick(kind, args[0])) is not None:
            if kind == "hold":
                assert self.sched.hold(seq.seq_id) is not seq.is_finished
            elif kind == "resume":
                self.sched.resume(seq.seq_id)
            else:
                if not seq.is_finished:
                    self.aborted.add(seq.seq_id)
                self.sched.finish(seq)
        self.check()

    def check(self) -> None:
        bm, sched = self.bm, self.sched
        live = list(sched.seqs.values())
        owners = [0] * bm.num_blocks
        for seq in live:
            assert len(set(seq.block_table)) == len(seq.block_table)
            for block in seq.block_table:
                owners[block] += 1
        assert bm.ref_counts == owners
        assert set(bm.free_queue) == {b for b in range(bm.num_blocks) if owners[b] == 0}
        assert sum(bm.ref_counts) == sum(len(s.block_table) for s in live)
        for h, block in bm.cached.items():
            assert bm.block_hash[block] == h
        for block, h in enumerate(bm.block_hash):
            assert h is None or bm.cached[h] == block

        queued = [*sched.waiting, *sched.running, *sched.held.values()]
        assert sorted(s.seq_id for s in queued) == sorted(sched.seqs)
        for queue in (sched.waiting, sched.running):
            assert queue == sorted(queue, key=lambda s: s.sort_key)
        for seq in sched.waiting:
            assert seq.status is SequenceStatus.WAITING and not seq.block_table
            assert seq.num_computed_tokens == 0
        for seq in sched.running:
            assert seq.status is SequenceStatus.RUNNING
        for seq in sched.held.values():
            assert seq.status is SequenceStatus.HELD
        for seq in [*sched.running, *sched.held.values()]:
            assert seq.num_computed_tokens <= len(seq.block_table) * BLOCK_SIZE
            assert seq.num_computed_tokens < seq.num_tokens or not seq.block_table
            # Every computed position reads back the KV of its own token and prefix.
            for pos in range(seq.num_computed_tokens):
                block = seq.block_table[pos // BLOCK_SIZE]
                assert self.kv[block, pos % BLOCK_SIZE] == tuple(seq.token_ids[: pos + 1])
        for seq in self.seqs:
            if seq.is_finished:
                assert not seq.block_table and seq.seq_id not in sched.seqs
            assert seq.num_output_tokens <= seq.params.max_tokens

    def run_until(self, done: Callable[[], bool], what: str) -> None:
        bound = 40 * (1 + sum(s.num_prompt_tokens + s.params.max_tokens for s in self.seqs))
        for _ in range(bound):
            if done():
                return
            self.step()
            self.check()
        assert done(), f"{what} starved: {self.sched.stats()}"

    def drain(self) -> None:
        sched = self.sched
        # Held sequences keep no one else waiting, except samples of a leader held mid-prefill.
        self.run_until(
            lambda: all(
                s.status is SequenceStatus.HELD or not s.may_start for s in sched.seqs.values()
            ),
            "with some held, the others",
        )
        for seq_id in list(sched.held):
            sched.resume(seq_id)
        self.check()
        self.run_until(lambda: not sched.num_unfinished, "with none held, everything")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_strategy)
def test_random_operations_keep_blocks_consistent_and_finish_everything(ops: list) -> None:
    h = Harness()
    for op in ops:
        h.apply(op)
    h.drain()
    assert h.bm.num_free_blocks == h.bm.num_blocks
    for seq in h.seqs:
        assert seq.is_finished
        if seq.seq_id not in h.aborted:
            assert seq.num_output_tokens == seq.params.max_tokens
