"""Builders shared by the scheduler tests: sequences, a scheduler, and a simulated engine."""

from __future__ import annotations

import itertools

from actors.config import SchedulerConfig
from actors.kv_cache import BlockManager
from actors.request import Sequence
from actors.sampling_params import SamplingParams
from actors.scheduler import Scheduler, SchedulerOutput

_ids = itertools.count()

SAMPLED_TOKEN = 7


def make_seq(
    prompt: int | list[int],
    max_tokens: int = 16,
    priority: int = 0,
    leader: Sequence | None = None,
    index: int = 0,
    name: str | None = None,
    namespace: str = "",
) -> Sequence:
    """A sequence; an int prompt means that many tokens no other sequence shares."""
    n = next(_ids)
    if isinstance(prompt, int):
        prompt = list(range(1000 * (n + 1), 1000 * (n + 1) + prompt))
    request_id = leader.request_id if leader is not None else (name or f"r{n}")
    return Sequence(
        seq_id=f"{request_id}#{index}",
        request_id=request_id,
        index=index,
        token_ids=list(prompt),
        num_prompt_tokens=len(prompt),
        params=SamplingParams(max_tokens=max_tokens),
        priority=priority,
        leader=leader,
        cache_namespace=namespace,
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 16,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 256,
    enable_chunked_prefill: bool = True,
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)
    return Scheduler(config, BlockManager(num_blocks, block_size))


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.on_step_done(out)
    for item in out.scheduled:
        if item.will_sample:
            item.seq.token_ids.append(SAMPLED_TOKEN)
            if item.seq.num_output_tokens >= item.seq.params.max_tokens:
                sched.finish(item.seq)
    return out


def run(sched: Scheduler, max_steps: int = 200) -> list[SchedulerOutput]:
    outs = []
    while sched.num_unfinished and len(outs) < max_steps:
        outs.append(step(sched))
    assert not sched.num_unfinished, f"not done after {max_steps} steps: {sched.stats()}"
    return outs


def chunks_of(seq: Sequence, outs: list[SchedulerOutput]) -> list[tuple[int, bool]]:
    return [(s.num_new_tokens, s.will_sample) for o in outs for s in o.scheduled if s.seq is seq]


def assert_all_blocks_free(sched: Scheduler) -> None:
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.ref_counts == [0] * bm.num_blocks
