"""BlockManager unit tests: block accounting, ref counts, LRU free queue, prefix cache."""

from __future__ import annotations

import itertools

import pytest

from actors.kv_cache import BlockManager
from actors.request import Sequence
from actors.sampling_params import SamplingParams

_ids = itertools.count()


def make_seq(token_ids: list[int], max_tokens: int = 16, namespace: str = "") -> Sequence:
    n = next(_ids)
    return Sequence(
        seq_id=f"s{n}#0",
        request_id=f"s{n}",
        index=0,
        token_ids=list(token_ids),
        num_prompt_tokens=len(token_ids),
        params=SamplingParams(max_tokens=max_tokens),
        cache_namespace=namespace,
    )


def fresh_tokens(n: int) -> list[int]:
    """Tokens no other call returns, so unrelated prompts never share a cached block."""
    base = 1000 * (next(_ids) + 1)
    return list(range(base, base + n))


def compute_prompt(bm: BlockManager, seq: Sequence) -> None:
    """What a finished prefill leaves behind: blocks allocated, tokens computed, cache filled."""
    hits = bm.match_prefix(seq)
    num_cached = len(hits) * bm.block_size
    assert bm.allocate(seq, seq.num_tokens - num_cached, hits)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def assert_consistent(bm: BlockManager, live: list[Sequence]) -> None:
    free = set(bm.free_queue)
    assert free == {b for b in range(bm.num_blocks) if bm.ref_counts[b] == 0}
    assert sum(bm.ref_counts) == sum(len(s.block_table) for s in live)


# ------------------------------------------------------------------------- allocation


@pytest.mark.parametrize(
    ("block_size", "chunks", "expected_num_blocks"),
    [
        (16, [1], [1]),
        (16, [16], [1]),
        (16, [17], [2]),
        (16, [40], [3]),
        # Decode after a prefill: a new block only when the last one is full.
        (16, [15, 1, 1, 15, 1], [1, 1, 2, 2, 3]),
        (4, [3, 3, 3, 3], [1, 2, 3, 3]),
        (1, [5, 1], [5, 6]),
    ],
)
def test_allocate_grows_block_table_by_ceil_of_tokens(
    block_size: int, chunks: list[int], expected_num_blocks: list[int]
) -> None:
    bm = BlockManager(num_blocks=16, block_size=block_size)
    seq = make_seq(fresh_tokens(sum(chunks)))
    for num_new, expected in zip(chunks, expected_num_blocks, strict=True):
        assert bm.allocate(seq, num_new)
        seq.num_computed_tokens += num_new
        assert len(seq.block_table) == expected
        assert len(set(seq.block_table)) == expected
        assert bm.num_free_blocks == 16 - expected
    assert_consistent(bm, [seq])


def test_allocate_without_room_returns_false_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=16)
    a, b = make_seq(fresh_tokens(48)), make_seq(fresh_tokens(32))
    assert bm.allocate(a, 48)
    table_a = list(a.block_table)

    assert not bm.allocate(b, 32)  # needs 2 blocks, 1 is free
    assert b.block_table == [] and b.block_hashes == []
    assert a.block_table == table_a
    assert bm.num_free_blocks == 1
    assert_consistent(bm, [a, b])

    # Growing a running sequence past the pool fails the same way.
    a.num_computed_tokens = 48
    assert not bm.allocate(a, 17)
    assert a.block_table == table_a and bm.num_free_blocks == 1
    assert bm.allocate(a, 16)
    assert bm.num_free_blocks == 0


def test_allocate_counts_free_cached_hits_against_the_room_left() -> None:
    bm = BlockManager(num_blocks=4, block_size=16)
    prompt = fresh_tokens(40)
    first = make_seq(prompt)
    compute_prompt(bm, first)
    bm.free(first)
    hog = make_seq(fresh_tokens(16))
    assert bm.allocate(hog, 16)  # takes the unhashed block, the 2 cached ones stay
    assert bm.num_free_blocks == 3

    # 2 free cached hits + 2 new blocks: taking the hits leaves only 1 free block.
    second = make_seq(prompt + fresh_tokens(24))
    hits = bm.match_prefix(second)
    assert len(hits) == 2
    assert not bm.allocate(second, second.num_tokens - 32, hits)
    assert second.block_table == []
    assert bm.num_free_blocks == 3
    assert all(bm.ref_counts[b] == 0 for b in hits)
    assert bm.match_prefix(make_seq(prompt)) == hits  # still cached
    assert_consistent(bm, [hog, second])


@pytest.mark.parametrize("prompt_lens", [[1], [16, 33, 100], [40, 40, 7, 1]])
def test_free_returns_every_block(prompt_lens: list[int]) -> None:
    bm = BlockManager(num_blocks=32, block_size=16)
    shared = fresh_tokens(100)
    seqs = [make_seq(shared[:n]) for n in prompt_lens]
    for seq in seqs:
        compute_prompt(bm, seq)
    assert bm.num_free_blocks < bm.num_blocks
    for seq in seqs:
        bm.free(seq)
        assert seq.block_table == [] and seq.block_hashes == []
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.ref_counts == [0] * bm.num_blocks
    assert_consistent(bm, [])


# ------------------------------------------------------------------------ prefix cache


@pytest.mark.parametrize(
    ("prompt_len", "expected_hits"),
    [
        (40, 2),
        # At least one prompt token is always computed (its logits give the first sample).
        (32, 1),
        (33, 2),
        (17, 1),
        (16, 0),
        (15, 0),
        (1, 0),
    ],
)
def test_same_prompt_hits_full_blocks_leaving_one_token_to_compute(
    prompt_len: int, expected_hits: int
) -> None:
    bm = BlockManager(num_blocks=16, block_size=16)
    prompt = fresh_tokens(prompt_len)
    first, second = make_seq(prompt), make_seq(prompt)
    compute_prompt(bm, first)

    hits = bm.match_prefix(second)
    assert hits == first.block_table[:expected_hits]
    assert bm.allocate(second, prompt_len - expected_hits * 16, hits)
    assert second.block_table[:expected_hits] == first.block_table[:expected_hits]
    assert not set(second.block_table[expected_hits:]) & set(first.block_table)
    assert len(second.block_table) == len(first.block_table)
    assert_consistent(bm, [first, second])


def test_shared_blocks_are_ref_counted_and_survive_freeing_one_owner() -> None:
    bm = BlockManager(num_blocks=8, block_size=16)
    prompt = fresh_tokens(40)
    first, second = make_seq(prompt), make_seq(prompt)
    compute_prompt(bm, first)
    compute_prompt(bm, second)
    shared = first.block_table[:2]
    assert second.block_table[:2] == shared
    assert [bm.ref_counts[b] for b in shared] == [2, 2]
    assert bm.num_used_blocks == 4  # 2 shared + one partial tail each

    tail = first.block_table[2]
    bm.free(first)
    assert [bm.ref_counts[b] for b in shared] == [1, 1]
    assert not set(shared) & set(bm.free_queue)
    assert tail in bm.free_queue
    assert bm.num_used_blocks == 3
    assert_consistent(bm, [second])

    third = make_seq(prompt)
    assert bm.match_prefix(third) == shared
    bm.free(second)
    assert bm.num_free_blocks == bm.num_blocks


def test_freed_cached_blocks_hit_until_evicted_unhashed_blocks_go_first() -> None:
    bm = BlockManager(num_blocks=5, block_size=16)
    prompt = fresh_tokens(40)
    first = make_seq(prompt)
    compute_prompt(bm, first)
    cached = first.block_table[:2]
    bm.free(first)
    assert bm.num_free_blocks == 5
    assert bm.match_prefix(make_seq(prompt)) == cached

    # Three blocks hold nothing reusable (never used, or the partial tail): taken first.
    filler = make_seq(fresh_tokens(48))
    assert bm.allocate(filler, 48)
    assert not set(filler.block_table) & set(cached)
    assert bm.match_prefix(make_seq(prompt)) == cached

    # Then the least useful cached block goes: the tail of the chain, so the prefix stays.
    one = make_seq(fresh_tokens(16))
    assert bm.allocate(one, 16)
    assert one.block_table == [cached[1]]
    assert bm.match_prefix(make_seq(prompt)) == cached[:1]

    two = make_seq(fresh_tokens(16))
    assert bm.allocate(two, 16)
    assert bm.match_prefix(make_seq(prompt)) == []
    assert bm.num_free_blocks == 0


def test_unhashed_block_freed_last_is_still_reused_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=16)
    prompt = fresh_tokens(32)
    cached = make_seq(prompt)
    compute_prompt(bm, cached)
    table = list(cached.block_table)
    scratch = make_seq(fresh_tokens(8))
    compute_prompt(bm, scratch)
    bm.free(cached)
    bm.free(scratch)  # freed after the cached blocks, but holds nothing reusable
    other = make_seq(fresh_tokens(32))
    assert bm.allocate(other, 32)
    assert bm.match_prefix(make_seq(prompt + [1])) == table


def test_hit_revives_a_freed_cached_block() -> None:
    bm = BlockManager(num_blocks=4, block_size=16)
    prompt = fresh_tokens(40)
    first = make_seq(prompt)
    compute_prompt(bm, first)
    bm.free(first)
    again = make_seq(prompt)
    compute_prompt(bm, again)
    assert again.num_computed_tokens == 40
    assert again.block_table[:2] == bm.match_prefix(make_seq(prompt))
    assert bm.num_free_blocks == 1
    assert_consistent(bm, [again])


@pytest.mark.parametrize(
    ("layout", "expected_hits"),
    [
        (["p1", "q", "tail"], 2),
        (["p1", "r", "tail"], 1),
        (["p2", "q", "tail"], 0),
        # The same tokens one position later: no block lines up.
        (["one", "p1", "q", "tail"], 0),
    ],
)
def test_hash_chain_hits_only_on_an_identical_prefix(layout: list[str], expected_hits: int) -> None:
    bm = BlockManager(num_blocks=16, block_size=16)
    blocks = {k: fresh_tokens(16) for k in ("p1", "p2", "q", "r")}
    blocks |= {"tail": fresh_tokens(8), "one": [7]}
    first = make_seq(blocks["p1"] + blocks["q"] + fresh_tokens(8))
    compute_prompt(bm, first)
    seq = make_seq([t for k in layout for t in blocks[k]])
    assert bm.match_prefix(seq) == first.block_table[:expected_hits]


def test_same_block_after_a_different_prefix_is_cached_apart() -> None:
    # KV depends on every earlier token: block `q` after `p2` must not reuse `q` after `p1`.
    bm = BlockManager(num_blocks=16, block_size=16)
    p1, p2, q = fresh_tokens(16), fresh_tokens(16), fresh_tokens(16)
    after_p1, after_p2 = make_seq(p1 + q + [1]), make_seq(p2 + q + [1])
    compute_prompt(bm, after_p1)
    compute_prompt(bm, after_p2)
    assert after_p2.block_table[1] != after_p1.block_table[1]
    assert bm.match_prefix(make_seq(p2 + q + [2])) == after_p2.block_table[:2]
    assert bm.match_prefix(make_seq(p1 + q + [2])) == after_p1.block_table[:2]


def test_decoded_tokens_fill_blocks_that_a_follow_up_prompt_hits() -> None:
    # Multi-turn chat: the next prompt is the previous prompt plus its answer.
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(fresh_tokens(6))
    compute_prompt(bm, seq)
    assert len(seq.block_hashes) == 1
    for token in (50, 51, 52):
        seq.token_ids.append(token)
        assert bm.allocate(seq, 1)
        seq.num_computed_tokens += 1
        bm.cache_full_blocks(seq)
    assert len(seq.block_hashes) == 2  # 9 computed tokens: 2 full blocks
    follow_up = make_seq(seq.token_ids + [60, 61])
    assert bm.match_prefix(follow_up) == seq.block_table[:2]


def test_duplicate_content_computed_twice_is_cached_once() -> None:
    bm = BlockManager(num_blocks=8, block_size=16)
    prompt = fresh_tokens(32)
    # Both prefilled in one step: neither could hit the other.
    a, b = make_seq(prompt), make_seq(prompt)
    for seq in (a, b):
        assert bm.allocate(seq, 32)
    for seq in (a, b):
        seq.num_computed_tokens = 32
        bm.cache_full_blocks(seq)
    assert a.block_hashes == b.block_hashes
    table_a = list(a.block_table)
    assert bm.match_prefix(make_seq(prompt + [1])) == table_a
    # b's copies hold nothing the cache points to: freed, they are reused before a's.
    bm.free(b)
    bm.free(a)
    c = make_seq(fresh_tokens(32))
    assert bm.allocate(c, 32)
    assert not set(c.block_table) & set(table_a)
    assert bm.match_prefix(make_seq(prompt + [1])) == table_a


def test_prefix_caching_disabled_never_hits() -> None:
    bm = BlockManager(num_blocks=8, block_size=16, enable_prefix_caching=False)
    prompt = fresh_tokens(40)
    first, second = make_seq(prompt), make_seq(prompt)
    compute_prompt(bm, first)
    assert bm.match_prefix(second) == []
    assert first.block_hashes == [] and bm.cached == {}
    compute_prompt(bm, second)
    assert not set(first.block_table) & set(second.block_table)


def test_reset_prefix_cache_forgets_only_unused_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=16)
    kept, dropped = fresh_tokens(40), fresh_tokens(40)
    live = make_seq(kept)
    compute_prompt(bm, live)
    gone = make_seq(dropped)
    compute_prompt(bm, gone)
    bm.free(gone)
    bm.reset_prefix_cache()
    assert bm.match_prefix(make_seq(dropped)) == []
    assert bm.match_prefix(make_seq(kept)) == live.block_table[:2]
    assert_consistent(bm, [live])


# ------------------------------------------------------------------ cache namespaces


@pytest.mark.parametrize(
    ("first_ns", "second_ns", "expected_hits"),
    [
        ("tenant:a", "tenant:a", 2),
        ("tenant:a", "tenant:b", 0),
        ("", "tenant:a", 0),
        ("tenant:a", "", 0),
    ],
)
def test_cached_blocks_are_shared_only_within_one_namespace(
    first_ns: str, second_ns: str, expected_hits: int
) -> None:
    bm = BlockManager(num_blocks=16, block_size=16)
    prompt = fresh_tokens(40)
    first = make_seq(prompt, namespace=first_ns)
    compute_prompt(bm, first)
    second = make_seq(prompt, namespace=second_ns)
    assert bm.match_prefix(second) == first.block_table[:expected_hits]
    compute_prompt(bm, second)
    shared = set(first.block_table) & set(second.block_table)
    assert len(shared) == expected_hits
    # Each namespace keeps its own copy cached: a third request of either one hits its own.
    for seq in (first, second):
        again = make_seq(prompt + [1], namespace=seq.cache_namespace)
        assert bm.match_prefix(again) == seq.block_table[:2]
    assert_consistent(bm, [first, second])


def test_a_namespace_never_meets_another_further_down_the_chain() -> None:
    # Whole chains differ, not only the first block: no later block lines up either.
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = fresh_tokens(13)
    a, b = make_seq(prompt, namespace="x"), make_seq(prompt, namespace="y")
    compute_prompt(bm, a)
    compute_prompt(bm, b)
    assert len(a.block_hashes) == len(b.block_hashes) == 3
    assert not set(a.block_hashes) & set(b.block_hashes)
