"""Scheduler unit tests: chunked prefill, decode batching, priority, preemption, hold, n > 1.

The engine is simulated: schedule, mark the step done, append one token per sampling
sequence and finish those that reached `max_tokens`.
"""

from __future__ import annotations

import itertools

import pytest

from actors.request import Sequence, SequenceStatus
from actors.scheduler import Scheduler
from tests.support.scheduler import (
    SAMPLED_TOKEN,
    assert_all_blocks_free,
    chunks_of,
    make_scheduler,
    make_seq,
    run,
    step,
)

_ids = itertools.count()
# --------------------------------------------------------------------- token budget


@pytest.mark.parametrize(
    ("prompt_len", "budget", "expected_chunks"),
    [
        (100, 32, [32, 32, 32, 4]),
        (32, 32, [32]),
        (33, 32, [32, 1]),
        (5, 32, [5]),
        (64, 16, [16, 16, 16, 16]),
    ],
)
def test_long_prompt_is_prefilled_in_chunks_and_only_the_last_samples(
    prompt_len: int, budget: int, expected_chunks: list[int]
) -> None:
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=budget)
    seq = make_seq(prompt_len, max_tokens=3)
    sched.add(seq)
    outs = run(sched)
    prefill = [(n, False) for n in expected_chunks[:-1]] + [(expected_chunks[-1], True)]
    assert chunks_of(seq, outs) == prefill + [(1, True), (1, True)]
    assert seq.output_token_ids == [SAMPLED_TOKEN] * 3
    assert_all_blocks_free(sched)


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole() -> None:
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=32, enable_chunked_prefill=False)
    first, second = make_seq(20, max_tokens=4), make_seq(20, max_tokens=4)
    sched.add(first)
    sched.add(second)
    outs = run(sched)
    assert [[s.num_new_tokens for s in o.scheduled] for o in outs[:2]] == [[20], [1, 20]]
    assert chunks_of(second, outs)[0] == (20, True)


def test_decodes_get_one_token_each_step_and_are_served_before_prefill() -> None:
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16)
    decoders = [make_seq(4, max_tokens=10) for _ in range(3)]
    for seq in decoders:
        sched.add(seq)
    first = step(sched)
    assert [(s.seq, s.num_new_tokens, s.will_sample) for s in first.scheduled] == [
        (seq, 4, True) for seq in decoders
    ]
    late = make_seq(40, max_tokens=2)
    sched.add(late)
    for _ in range(3):
        out = step(sched)
        # Running decodes first, one token each; the new prompt takes what is left.
        assert [s.seq for s in out.scheduled] == [*decoders, late]
        assert [s.num_new_tokens for s in out.scheduled] == [1, 1, 1, 13]
        assert out.num_batched_tokens == 16
        assert [s.will_sample for s in out.scheduled[:3]] == [True] * 3
        assert not out.scheduled[-1].will_sample
    out = step(sched)  # 13 * 3 = 39: the last prompt token, which samples
    assert [(s.num_new_tokens, s.will_sample) for s in out.scheduled] == [(1, True)] * 4
    run(sched)
    assert [s.num_output_tokens for s in decoders] == [10, 10, 10]
    assert_all_blocks_free(sched)


def test_max_num_seqs_caps_the_batch() -> None:
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(8, max_tokens=3) for _ in range(5)]
    for seq in seqs:
        sched.add(seq)
    outs = run(sched)
    assert max(len(o.scheduled) for o in outs) == 2
    assert [s.seq for s in outs[0].scheduled] == seqs[:2]
    assert all(s.num_output_tokens == 3 for s in seqs)


def test_max_num_seqs_holds_after_a_held_sequence_resumes() -> None:
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(8, max_tokens=6) for _ in range(3)]
    sched.add(seqs[0])
    step(sched)
    sched.hold(seqs[0].seq_id)
    sched.add(seqs[1])
    sched.add(seqs[2])
    step(sched)
    sched.resume(seqs[0].seq_id)  # it kept its blocks: straight back to running
    outs = run(sched)
    assert max(len(o.scheduled) for o in outs) <= 2
    assert all(s.num_output_tokens == 6 for s in seqs)


@pytest.mark.parametrize(
    ("priorities", "expected_order"),
    [
        ([0, 0, 0, 0], [0, 1, 2, 3]),
        ([0, -1, 0, -2], [3, 1, 0, 2]),
        ([5, 1, 1, 0], [3, 1, 2, 0]),
    ],
)
def test_waiting_sequences_start_by_priority_then_arrival(
    priorities: list[int], expected_order: list[int]
) -> None:
    sched = make_scheduler(max_num_seqs=1)
    seqs = [make_seq(8, max_tokens=2, priority=p) for p in priorities]
    for seq in seqs:
        sched.add(seq)
    outs = run(sched)
    started = []
    for out in outs:
        for s in out.scheduled:
            if s.seq not in started:
                started.append(s.seq)
    assert started == [seqs[i] for i in expected_order]


def test_adding_a_scheduled_sequence_twice_is_refused() -> None:
    sched = make_scheduler()
    seq = make_seq(8)
    sched.add(seq)
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add(seq)


# ------------------------------------------------------------------------- preemption


# Namespaces of a and b: one shared, or one each (tenants): recompute hits its own blocks.
@pytest.mark.parametrize("namespaces", [("", ""), ("tenant:a", "tenant:b")])
def test_out_of_blocks_preempts_the_latest_by_recompute_and_it_still_completes(
    namespaces: tuple[str, str],
) -> None:
    # 5 blocks of 4 tokens; two 6-token prompts outgrow them after a few decodes.
    sched = make_scheduler(num_blocks=5, block_size=4)
    a = make_seq(6, max_tokens=8, namespace=namespaces[0])
    b = make_seq(6, max_tokens=4, namespace=namespaces[1])
    sched.add(a)
    sched.add(b)
    outs = [step(sched) for _ in range(3)]
    assert all(o.preempted == [] for o in outs)
    assert b.num_cached_tokens == 0

    out = step(sched)
    assert out.preempted == [b]
    assert [s.seq for s in out.scheduled] == [a]
    assert b.status is SequenceStatus.WAITING and b in sched.waiting
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert b.num_output_tokens == 3  # what it sampled before is kept, only KV is lost

    outs = run(sched)
    redo = next(s for o in outs for s in o.scheduled if s.seq is b)
    # Recompute prompt + earlier outputs, minus the one block still in the prefix cache.
    assert (redo.num_new_tokens, redo.will_sample) == (9 - 4, True)
    assert b.num_cached_tokens == 0  # reported at first admission only
    assert a.num_preemptions == 0
    assert (a.num_output_tokens, b.num_output_tokens) == (8, 4)
    assert_all_blocks_free(sched)


@pytest.mark.parametrize(
    ("priorities", "expected_victim"),
    [
        ([0, 0, 0], 2),
        ([0, 0, -1], 1),
        ([1, 0, 0], 0),
    ],
)
def test_preemption_victim_is_the_lowest_priority_latest_running(
    priorities: list[int], expected_victim: int
) -> None:
    # Three 4-token prompts fill 3 of 4 blocks of 4; the first to need a new block forces out
    # one sequence.
    sched = make_scheduler(num_blocks=4, block_size=4)
    seqs = [make_seq(4, max_tokens=6, priority=p) for p in priorities]
    for seq in seqs:
        sched.add(seq)
    preempted = [p for o in run(sched) for p in o.preempted]
    assert preempted[0] is seqs[expected_victim]
    assert all(s.num_output_tokens == 6 for s in seqs)
    assert_all_blocks_free(sched)


# ------------------------------------------------------------------------------- hold


def test_held_sequence_is_skipped_keeps_its_blocks_and_resumes() -> None:
    sched = make_scheduler()
    a, b = make_seq(20, max_tokens=5), make_seq(20, max_tokens=5)
    sched.add(a)
    sched.add(b)
    step(sched)
    table = list(a.block_table)
    assert sched.hold(a.seq_id)
    assert a.status is SequenceStatus.HELD
    for _ in range(3):
        out = step(sched)
        assert [s.seq for s in out.scheduled] == [b]
    assert a.block_table == table and a.num_output_tokens == 1
    assert sched.stats()["held"] == 1

    assert sched.resume(a.seq_id)
    assert a.status is SequenceStatus.RUNNING
    out = step(sched)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 1)]
    run(sched)
    assert a.num_preemptions == 0 and a.num_output_tokens == 5
    assert_all_blocks_free(sched)


def test_hold_and_resume_of_unknown_ids() -> None:
    sched = make_scheduler()
    seq = make_seq(4)
    assert not sched.hold("nope")
    assert not sched.resume("nope")
    sched.add(seq)
    assert not sched.resume(seq.seq_id)  # not held
    assert sched.hold(seq.seq_id) and sched.hold(seq.seq_id)
    assert sched.resume(seq.seq_id) and not sched.resume(seq.seq_id)
    assert seq.status is SequenceStatus.WAITING


def test_held_sequences_are_preempted_first_when_blocks_run_short() -> None:
    # 4 blocks of 4: `held` has top priority but is preempted before the running `low`.
    sched = make_scheduler(num_blocks=4, block_size=4)
    held = make_seq(4, max_tokens=4, priority=-1)
    low = make_seq(4, max_tokens=8, priority=1)
    mid = make_seq(4, max_tokens=8, priority=0)
    for seq in (held, low, mid):
        sched.add(seq)
    step(sched)
    sched.hold(held.seq_id)
    preempted: list[Sequence] = []
    while not preempted:
        preempted = step(sched).preempted
    assert preempted == [held]
    assert held.status is SequenceStatus.HELD and held.block_table == []
    assert held.num_computed_tokens == 0
    assert low.num_preemptions == 0

    sched.resume(held.seq_id)  # its KV is gone: it waits and recomputes
    assert held.status is SequenceStatus.WAITING
    run(sched)
    assert (held.num_output_tokens, low.num_output_tokens, mid.num_output_tokens) == (4, 8, 8)
    assert_all_blocks_free(sched)


def test_held_sequence_gives_its_blocks_up_to_a_new_request() -> None:
    # A client that stopped reading must not keep everyone else out of a full pool.
    sched = make_scheduler(num_blocks=4, block_size=4)
    held = make_seq(12, max_tokens=3)
    sched.add(held)
    step(sched)
    sched.hold(held.seq_id)
    newcomer = make_seq(8, max_tokens=3)  # 2 blocks; 1 is free
    sched.add(newcomer)
    out = step(sched)
    assert [s.seq for s in out.scheduled] == [newcomer]
    assert out.preempted == [held]
    assert held.status is SequenceStatus.HELD and held.block_table == []
    while newcomer.seq_id in sched.seqs:
        step(sched)
    sched.resume(held.seq_id)
    run(sched)
    assert (held.num_output_tokens, newcomer.num_output_tokens) == (3, 3)
    assert_all_blocks_free(sched)


# ----------------------------------------------------------------------------- finish


def _to_state(sched: Scheduler, seq: Sequence, state: str) -> None:
    if state == "waiting":
        return
    step(sched)
    if state == "running":
        return
    sched.hold(seq.seq_id)
    if state == "held_preempted":
        step(sched)  # `other` is admitted and takes the held sequence's blocks
        assert seq.block_table == [] and seq.num_preemptions == 1


@pytest.mark.parametrize("state", ["waiting", "running", "held", "held_preempted"])
def test_finish_frees_everything_and_is_idempotent(state: str) -> None:
    # 4 blocks of 16: `seq` takes 3 of them, `other` needs 2.
    sched = make_scheduler(num_blocks=4, max_num_seqs=1)
    seq = make_seq(40)
    other = make_seq(20, max_tokens=2, priority=1)
    sched.add(seq)
    sched.add(other)
    _to_state(sched, seq, state)

    sched.finish(seq)
    assert seq.status is SequenceStatus.FINISHED and seq.block_table == []
    assert seq not in sched.waiting and seq not in sched.running
    assert seq.seq_id not in sched.held and sched.num_unfinished == 1
    assert sched.block_manager.num_used_blocks == len(other.block_table)
    sched.finish(seq)
    assert sched.num_unfinished == 1
    assert sched.block_manager.num_used_blocks == len(other.block_table)
    assert not sched.resume(seq.seq_id) and not sched.hold(seq.seq_id)

    outs = run(sched)
    assert all(s.seq is other for o in outs for s in o.scheduled)
    assert other.num_output_tokens == 2
    assert_all_blocks_free(sched)


# ------------------------------------------------------------------------------ n > 1


@pytest.mark.parametrize(
    ("budget", "leader_chunks", "sample_chunks"),
    [(256, [40], [8, 8]), (16, [16, 16, 8], [8, 7])],
)
def test_samples_wait_for_the_leader_prompt_then_share_its_blocks(
    budget: int, leader_chunks: list[int], sample_chunks: list[int]
) -> None:
    sched = make_scheduler(max_num_batched_tokens=budget)
    leader = make_seq(40, max_tokens=3)
    samples = [
        make_seq(leader.prompt_token_ids, max_tokens=3, leader=leader, index=i) for i in (1, 2)
    ]
    for seq in (leader, *samples):
        sched.add(seq)
    for chunk in leader_chunks:
        out = step(sched)
        assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(leader, chunk)]

    out = step(sched)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [
        (leader, 1),
        (samples[0], sample_chunks[0]),
        (samples[1], sample_chunks[1]),
    ]
    shared = leader.block_table[:2]
    bm = sched.block_manager
    for sample in samples:
        assert sample.block_table[:2] == shared
        assert sample.num_cached_tokens == 32
    assert [bm.ref_counts[b] for b in shared] == [3, 3]
    assert leader.num_cached_tokens == 0

    run(sched)
    assert all(s.num_output_tokens == 3 for s in (leader, *samples))
    assert_all_blocks_free(sched)


def test_samples_share_the_leader_prompt_but_another_namespace_does_not() -> None:
    sched = make_scheduler()
    leader = make_seq(40, max_tokens=3, namespace="tenant:a")
    sample = make_seq(
        leader.prompt_token_ids, max_tokens=3, leader=leader, index=1, namespace="tenant:a"
    )
    sched.add(leader)
    sched.add(sample)
    step(sched)  # the leader's prompt is computed and cached
    other = make_seq(leader.prompt_token_ids, max_tokens=3, namespace="tenant:b")
    sched.add(other)
    out = step(sched)
    assert {(s.seq, s.num_new_tokens) for s in out.scheduled} == {
        (leader, 1),
        (sample, 8),
        (other, 40),
    }
    assert sample.num_cached_tokens == 32 and sample.block_table[:2] == leader.block_table[:2]
    assert other.num_cached_tokens == 0
    assert not set(other.block_table) & set(leader.block_table)
    run(sched)
    assert_all_blocks_free(sched)


def test_sample_of_a_finished_leader_starts_and_hits_its_cached_blocks() -> None:
    sched = make_scheduler()
    leader = make_seq(40, max_tokens=1)
    sample = make_seq(leader.prompt_token_ids, max_tokens=2, leader=leader, index=1)
    sched.add(leader)
    sched.add(sample)
    step(sched)
    assert leader.is_finished
    out = step(sched)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(sample, 8)]
    assert sample.num_cached_tokens == 32
