"""Sampler unit tests on hand-made logits: no model, no Ray, CPU only."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import xgrammar
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from actors.layers import kernels
from actors.sampler import NO_TOKEN, Sampler, SeqSamplingState
from actors.sampling_params import SamplingParams
from tests.support.grammar import masked_by_bits

VOCAB = 40
EOS_IDS = (1, 4)
# A known distribution over 8 tokens (best first), for the filters and the frequency checks.
PROBS = torch.tensor([0.30, 0.25, 0.15, 0.12, 0.08, 0.05, 0.03, 0.02])
LOGITS8 = PROBS.log()
# Upper 0.1% points of chi-square for df = 7 and df = 3.
CHI2_CRIT = {7: 24.32, 3: 16.27}


def make_state(
    seed: int | None = None,
    prompt_ids: tuple[int, ...] = (),
    output_ids: tuple[int, ...] = (),
    **params: object,
) -> SeqSamplingState:
    return SeqSamplingState(SamplingParams(**params), list(prompt_ids), list(output_ids), seed)


def sample_counts(row: torch.Tensor, num_draws: int, seeded: bool = False, **params) -> Counter:
    """Draw `num_draws` times from one logits row (one batch of identical rows)."""
    sampler = Sampler(row.shape[0], EOS_IDS, seed=1234)
    states = [make_state(seed=i if seeded else None, **params) for i in range(num_draws)]
    tokens, _ = sampler(row.repeat(num_draws, 1), states)
    return Counter(tokens)


def chi_square(counts: Counter, probs: torch.Tensor) -> float:
    n = sum(counts.values())
    return sum((counts[i] - n * float(p)) ** 2 / (n * float(p)) for i, p in enumerate(probs))


def allow_only(bitmask: torch.Tensor, row: int, token_ids: set[int]) -> None:
    """Set one xgrammar bitmask row (bit t % 32 of word t // 32) to exactly `token_ids`."""
    words = [0] * bitmask.shape[1]
    for t in token_ids:
        words[t // 32] |= 1 << (t % 32)
    signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]
    bitmask[row] = torch.tensor(signed, dtype=torch.int32)


def one_hot_logits(values: dict[int, float], base: float = 0.0) -> torch.Tensor:
    logits = torch.full((VOCAB,), base)
    for t, v in values.items():
        logits[t] = v
    return logits


# ---------------------------------------------------------------- greedy and seeded draws


def test_greedy_rows_take_argmax_while_random_rows_sample() -> None:
    g = torch.Generator().manual_seed(0)
    sampler = Sampler(VOCAB, EOS_IDS, seed=0)
    states = [
        make_state(temperature=0.0),
        make_state(temperature=1.0),
        make_state(temperature=0.0, top_k=5, repetition_penalty=1.0),
        make_state(temperature=1.5),
    ]
    random_tokens: list[int] = []
    num_argmax = 0
    for _ in range(40):
        logits = torch.randn(4, VOCAB, generator=g)
        tokens, logprobs = sampler(logits, states)
        assert tokens[0] == int(logits[0].argmax())
        assert tokens[2] == int(logits[2].argmax())
        random_tokens += [tokens[1], tokens[3]]
        num_argmax += (tokens[1] == int(logits[1].argmax())) + (
            tokens[3] == int(logits[3].argmax())
        )
        assert logprobs is None
    assert len(set(random_tokens)) > 10
    assert num_argmax < 40
    # The sampler records each drawn token in its state (penalties read them).
    assert len(states[0].output_token_ids) == 40


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", ["greedy", "mixed"])
def test_the_cpu_kernels_draw_what_torchs_ops_draw(dtype, batch) -> None:
    assert kernels.available()
    vocab = 49152

    def states() -> list[SeqSamplingState]:
        if batch == "greedy":
            return [make_state(temperature=0.0) for _ in range(6)]
        return [make_state(temperature=0.0), make_state(seed=5, temperature=0.9, top_p=0.9)] + [
            make_state(temperature=1.0) for _ in range(2)
        ]

    ours, ours_states = Sampler(vocab, EOS_IDS, seed=2, cpu_kernels=True), states()
    torchs, torchs_states = Sampler(vocab, EOS_IDS, seed=2), states()
    g = torch.Generator().manual_seed(3)
    for _ in range(8):
        logits = torch.randn(len(ours_states), vocab, generator=g).to(dtype)
        logits[0, 10:20] = logits[0].max() + 1  # a tie: the first index wins on both
        got, _ = ours(logits, ours_states)
        assert got == torchs(logits, torchs_states)[0]
        assert got[0] == 10


def _seeded_run(seed: int, position: int, mates: list[SeqSamplingState], noise: int) -> list[int]:
    """50 draws for a seeded row at `position` among `mates`; its logits are fixed per step."""
    sampler = Sampler(VOCAB, EOS_IDS, seed=noise)
    target = make_state(seed=seed, temperature=0.8, top_p=0.95)
    states = list(mates)
    states.insert(position, target)
    row_gen = torch.Generator().manual_seed(7)
    mate_gen = torch.Generator().manual_seed(noise)
    for _ in range(50):
        logits = torch.randn(len(states), VOCAB, generator=mate_gen)
        logits[position] = torch.randn(VOCAB, generator=row_gen)
        sampler(logits, states)
    return target.output_token_ids


def test_seeded_row_draws_the_same_tokens_whatever_its_batch_mates() -> None:
    alone = _seeded_run(seed=42, position=0, mates=[], noise=0)
    mates = [
        make_state(temperature=1.0),
        make_state(seed=99, temperature=1.2, top_k=3),
        make_state(temperature=0.0),
        make_state(temperature=0.7, min_p=0.2, repetition_penalty=1.3, frequency_penalty=0.5),
    ]
    batched = _seeded_run(seed=42, position=2, mates=mates, noise=1)
    assert batched == alone
    assert len(set(alone)) > 10  # really sampled, not a constant
    other_seed = _seeded_run(seed=43, position=0, mates=[], noise=0)
    assert other_seed != alone


def test_unseeded_rows_share_the_sampler_seed() -> None:
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3))
    runs = [
        [Sampler(VOCAB, EOS_IDS, seed=s)(row.repeat(20, 1), [make_state() for _ in range(20)])[0]]
        for s in (5, 5, 6)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


# ---------------------------------------------------------------- the sampled distribution


@pytest.mark.parametrize("seeded", [False, True], ids=["shared-generator", "per-row-seeds"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_frequencies_match_softmax(temperature: float, seeded: bool) -> None:
    num_draws = 4000
    counts = sample_counts(LOGITS8, num_draws, seeded=seeded, temperature=temperature)
    expected = torch.softmax(LOGITS8 / temperature, dim=-1)
    assert chi_square(counts, expected) < CHI2_CRIT[7]
    freqs = torch.tensor([counts[i] / num_draws for i in range(8)])
    assert float((freqs - expected).abs().max()) < 0.03


# ---------------------------------------------------------------- top-k / top-p / min-p


def _hf_survivors(top_k: int, top_p: float, min_p: float) -> set[int]:
    scores = LOGITS8.clone().unsqueeze(0)
    warpers = []
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p > 0.0:
        warpers.append(MinPLogitsWarper(min_p))
    for warper in warpers:
        scores = warper(torch.zeros(1, 0, dtype=torch.long), scores)
    return {int(t) for t in torch.isfinite(scores[0]).nonzero().flatten()}


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p", "allowed"),
    [
        (2, 1.0, 0.0, {0, 1}),
        (-1, 1.0, 0.0, set(range(8))),  # -1 disables top-k
        (0, 0.5, 0.0, {0, 1}),  # mass before token 2 is 0.55 >= 0.5
        (0, 0.6, 0.0, {0, 1, 2}),
        # top-p on the renormalised top-3 (0.43, 0.36, 0.21): token 2 has 0.79 before it.
        (3, 0.6, 0.0, {0, 1}),
        (0, 1.0, 0.3, {0, 1, 2, 3}),  # keep p >= 0.3 * 0.30
        (5, 0.9, 0.45, {0, 1, 2}),
    ],
)
def test_top_filters_only_ever_draw_allowed_tokens(
    top_k: int, top_p: float, min_p: float, allowed: set[int]
) -> None:
    assert _hf_survivors(top_k, top_p, min_p) == allowed  # same semantics as HF's warpers
    counts = sample_counts(LOGITS8, 3000, top_k=top_k, top_p=top_p, min_p=min_p)
    assert set(counts) == allowed
    kept = PROBS[sorted(allowed)] / PROBS[sorted(allowed)].sum()
    if len(allowed) == 4:
        assert (
            chi_square(Counter({i: counts[t] for i, t in enumerate(sorted(allowed))}), kept)
            < (CHI2_CRIT[3])
        )


def test_top_filters_apply_per_row() -> None:
    kinds = [dict(top_k=1), dict(), dict(min_p=0.6), dict(top_p=0.25)]
    states = [make_state(**kinds[i % 4]) for i in range(2000)]
    tokens, _ = Sampler(8, EOS_IDS, seed=0)(LOGITS8.repeat(2000, 1), states)
    by_kind = [set(tokens[k::4]) for k in range(4)]
    assert by_kind == [{0}, set(range(8)), {0, 1}, {0}]


# ---------------------------------------------------------------- penalties


@pytest.mark.parametrize(
    ("values", "prompt_ids", "output_ids", "penalty", "expected"),
    [
        ({5: 2.0, 6: 1.9}, (5,), (), 1.2, 6),  # positive logit divided: 1.67 < 1.9
        ({5: -1.0, 6: -1.1}, (5,), (), 1.2, 6),  # negative logit multiplied: -1.2 < -1.1
        ({5: 2.0, 6: 1.9}, (), (5,), 1.2, 6),  # output tokens count too
        ({5: 2.0, 6: 1.9}, (5, 5, 5), (), 1.02, 5),  # once per token, not per occurrence
        ({5: 1.0, 6: 1.9}, (5,), (), 0.5, 5),  # < 1 encourages: 2.0 > 1.9
        ({5: 2.0, 6: 1.9}, (6,), (), 1.2, 5),  # only seen tokens are touched
    ],
)
def test_repetition_penalty_follows_hf(
    values: dict[int, float],
    prompt_ids: tuple[int, ...],
    output_ids: tuple[int, ...],
    penalty: float,
    expected: int,
) -> None:
    logits = one_hot_logits(values, base=-5.0)
    state = make_state(
        prompt_ids=prompt_ids, output_ids=output_ids, temperature=0.0, repetition_penalty=penalty
    )
    tokens, _ = Sampler(VOCAB, EOS_IDS)(logits.unsqueeze(0), [state])
    assert tokens == [expected]
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    seen = torch.tensor([list(prompt_ids + output_ids)])
    assert int(hf(seen, logits.unsqueeze(0).clone()).argmax()) == expected


@pytest.mark.parametrize(
    ("prompt_ids", "output_ids", "params", "expected"),
    [
        ((), (0, 0, 0), dict(frequency_penalty=0.2), 2),  # 3.0 - 3 * 0.2 = 2.4 < 2.5
        ((), (0, 0, 0), dict(presence_penalty=0.2), 0),  # 3.0 - 0.2 = 2.8 > 2.5
        ((), (0, 0, 0), dict(presence_penalty=0.6), 2),  # 2.4 < 2.5
        ((), (0, 2), dict(frequency_penalty=0.3, presence_penalty=0.2), 0),  # both drop by 0.5
        ((0, 0, 0), (), dict(presence_penalty=2.0, frequency_penalty=2.0), 0),  # prompt: no effect
        ((), (2,), dict(frequency_penalty=-1.0), 2),  # negative encourages: 3.5 > 3.0
    ],
)
def test_presence_and_frequency_penalties_follow_openai(
    prompt_ids: tuple[int, ...], output_ids: tuple[int, ...], params: dict, expected: int
) -> None:
    logits = one_hot_logits({0: 3.0, 2: 2.5})
    state = make_state(prompt_ids=prompt_ids, output_ids=output_ids, temperature=0.0, **params)
    tokens, _ = Sampler(VOCAB, EOS_IDS)(logits.unsqueeze(0), [state])
    assert tokens == [expected]


def test_penalties_stay_in_their_row() -> None:
    logits = one_hot_logits({0: 3.0, 2: 2.5}).repeat(2, 1)
    states = [
        make_state(output_ids=(0, 0), temperature=0.0, frequency_penalty=1.0),
        make_state(output_ids=(0, 0), temperature=0.0),
    ]
    tokens, _ = Sampler(VOCAB, EOS_IDS)(logits, states)
    assert tokens == [2, 0]


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_bans_eos_and_stop_tokens_until_reached() -> None:
    # Best first: EOS 1, EOS 4, stop token 7, then 9.
    logits = one_hot_logits({1: 5.0, 4: 4.5, 7: 4.0, 9: 3.0}).unsqueeze(0)
    sampler = Sampler(VOCAB, EOS_IDS)
    state = make_state(temperature=0.0, min_tokens=3, stop_token_ids=[7])
    drawn = [sampler(logits, [state])[0][0] for _ in range(4)]
    assert drawn == [9, 9, 9, 1]


def test_min_tokens_with_ignore_eos_still_bans_stop_tokens() -> None:
    logits = one_hot_logits({7: 5.0, 1: 4.0, 9: 3.0}).unsqueeze(0)
    sampler = Sampler(VOCAB, EOS_IDS)
    state = make_state(temperature=0.0, min_tokens=2, stop_token_ids=[7], ignore_eos=True)
    drawn = [sampler(logits, [state])[0][0] for _ in range(3)]
    assert drawn == [1, 1, 7]


def test_min_tokens_bans_for_random_rows_too() -> None:
    logits = one_hot_logits({1: 2.0, 4: 2.0, 7: 2.0}).repeat(500, 1)
    states = [make_state(min_tokens=1, stop_token_ids=[7]) for _ in range(500)]
    tokens, _ = Sampler(VOCAB, EOS_IDS)(logits, states)
    assert not {1, 4, 7} & set(tokens)
    assert len(set(tokens)) > 20


# ---------------------------------------------------------------- grammar bitmask


MASK_PATHS = pytest.mark.parametrize("mask_kernel", [False, True], ids=["xgrammar", "kernel"])


def mask_sampler(vocab: int, mask_kernel: bool, seed: int = 0) -> Sampler:
    """The sampler on either path for a forbidden winner: xgrammar's in-place mask, or the
    engine's `masked_argmax` kernel (built by `make kernels`, so present wherever tests run)."""
    if mask_kernel:
        assert kernels.available()
    return Sampler(vocab, EOS_IDS, seed=seed, cpu_kernels=mask_kernel)


@MASK_PATHS
def test_bitmask_restricts_only_listed_rows_and_empty_mask_gives_no_token(mask_kernel) -> None:
    vocab = 70  # not a multiple of 32: the last word is partly padding
    allowed = {5, 31, 33, 64}
    bitmask = xgrammar.allocate_token_bitmask(4, vocab)
    bitmask[0] = 0  # not listed, so ignored although it allows nothing
    allow_only(bitmask, 1, allowed)
    bitmask[2] = 0  # listed: nothing is allowed
    allow_only(bitmask, 3, allowed)
    states = [
        make_state(),
        make_state(logprobs=1),
        make_state(logprobs=1),
        make_state(temperature=0.0),
    ]
    sampler = mask_sampler(vocab, mask_kernel)
    g = torch.Generator().manual_seed(0)
    seen: list[set[int]] = [set(), set(), set(), set()]
    for _ in range(200):
        logits = torch.randn(4, vocab, generator=g)
        tokens, logprobs = sampler(logits, states, bitmask, [1, 2, 3])
        for i, t in enumerate(tokens):
            seen[i].add(t)
        best_allowed = max(allowed, key=lambda t: float(logits[3, t]))
        assert tokens[3] == best_allowed
        assert logprobs is not None and logprobs[2] is None and logprobs[1] is not None
    assert len(seen[0] - allowed) > 30
    assert seen[1] == allowed
    assert seen[2] == {NO_TOKEN}
    assert states[2].output_token_ids == []  # a dead row records nothing


@MASK_PATHS
@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.0},
        {"temperature": 0.0, "repetition_penalty": 1.3},
        {"temperature": 0.8},
        {"temperature": 1.0, "top_k": 5},
        {"temperature": 1.0, "top_p": 0.7},
    ],
    ids=["greedy", "greedy-penalised", "sampled", "top-k", "top-p"],
)
def test_masked_rows_draw_what_masking_the_logits_first_draws(params, mask_kernel) -> None:
    """The sampler masks only rows whose unmasked winner the grammar forbids (and rows a
    top filter renormalises): each row's token is still the one it would draw from logits
    masked beforehand, with the same noise, allowed or dead alike."""
    vocab, rows = 100, 12
    g = torch.Generator().manual_seed(7)
    for trial in range(20):
        logits = torch.randn(rows, vocab, generator=g) * 3
        bitmask = xgrammar.allocate_token_bitmask(rows, vocab)
        for r in range(rows):
            chosen = torch.randperm(vocab, generator=g)[: [1, 3, 30, 90][r % 4]].tolist()
            allow_only(bitmask, r, set(chosen))
        bitmask[rows - 1] = 0  # nothing allowed: the grammar's end
        listed = [r for r in range(rows) if r % 5 != 4]  # unlisted rows stay free
        masked_first = masked_by_bits(logits, bitmask, listed)

        def states(trial: int = trial) -> list[SeqSamplingState]:
            return [
                make_state(seed=100 * trial + r, prompt_ids=(3,), **params) for r in range(rows)
            ]

        ours, _ = mask_sampler(vocab, mask_kernel, seed=5)(logits, states(), bitmask, listed)
        reference, _ = Sampler(vocab, EOS_IDS, seed=5)(masked_first, states())
        for r in range(rows):
            if r == rows - 1 and r in listed:
                assert ours[r] == NO_TOKEN
            else:
                assert ours[r] == reference[r], (trial, r)
                if r in listed:
                    assert bitmask[r, ours[r] // 32] >> (ours[r] % 32) & 1


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_of_the_raw_logits() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=g)
    logits[0, 3], logits[0, 8] = 5.0, 4.9
    states = [
        # The penalty moves the greedy choice from 3 to 8; logprobs still describe raw logits.
        make_state(prompt_ids=(3,), temperature=0.0, repetition_penalty=2.0, logprobs=5),
        make_state(temperature=0.5, top_k=3, logprobs=0),
        make_state(temperature=1.0),
    ]
    tokens, logprobs = Sampler(VOCAB, EOS_IDS)(logits, states)
    assert logprobs is not None
    raw = torch.log_softmax(logits, dim=-1)
    assert tokens[0] == 8
    first = logprobs[0]
    assert first is not None
    assert first.logprob == pytest.approx(float(raw[0, 8]), abs=1e-6)
    assert first.rank == 2
    assert len(first.top) == 5
    assert [t for t, _ in first.top] == raw[0].topk(5).indices.tolist()
    values = [v for _, v in first.top]
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx(raw[0].topk(5).values.tolist(), abs=1e-6)
    second = logprobs[1]
    assert second is not None and second.top == []
    assert second.logprob == pytest.approx(float(raw[1, tokens[1]]), abs=1e-6)
    assert second.rank == 1 + int((raw[1] > raw[1, tokens[1]]).sum())
    assert logprobs[2] is None


def test_logprob_ranks_over_many_draws() -> None:
    states = [make_state(logprobs=2) for _ in range(500)]
    tokens, logprobs = Sampler(8, EOS_IDS)(LOGITS8.repeat(500, 1), states)
    assert logprobs is not None
    for t, lp in zip(tokens, logprobs, strict=True):
        assert lp is not None
        assert lp.rank == t + 1  # LOGITS8 is sorted best first
        assert lp.logprob == pytest.approx(math.log(float(PROBS[t])), abs=1e-5)
        assert [i for i, _ in lp.top] == [0, 1]


def test_sampler_leaves_the_callers_logits_alone() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    states = [
        make_state(prompt_ids=(1, 2, 3), output_ids=(5,), repetition_penalty=1.5, min_tokens=3),
        make_state(output_ids=(5, 5), frequency_penalty=1.0, presence_penalty=1.0),
    ]
    bitmask = xgrammar.allocate_token_bitmask(2, VOCAB)
    allow_only(bitmask, 1, {5, 6})
    Sampler(VOCAB, EOS_IDS)(logits, states, bitmask, [1])
    assert torch.equal(logits, before)
