"""Model proposers (`draft_model`, `self_draft`): greedy outputs are exactly ordinary decode's,
sampled ones keep the target's distribution through rejection sampling against the draft's
own (the rule here; over 20,000 engine samples in test_speculative.py), a seed repeats its
tokens, grammars hold, and the draft's KV (kept across steps in the target's block ids) stays
exact through preemption and chunked prefill.

A draft of the target itself must have every drafted token accepted: any error in what the
draft's cache holds would show as a rejection. `tiny` seed 1 drafting for seed 0 (the same
factory tokenizer) is the two-checkpoint case; with random weights nearly all of its drafts
are rejected, which exercises rollback and the residual draw."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from actors import LLM, SamplingParams
from actors.grammar_state import GrammarConstraint
from actors.sampler import NO_TOKEN, race
from actors.spec_decode import SpeculativeConfig
from actors.spec_decode.verify import accept_sampled
from serve_app.grammar.convert import spec_ebnf
from tests.engine.test_speculative import (
    NGRAM,
    PROMPTS,
    assert_same_committed,
    chi_square_p_below_001,
    tokens,
)

SMALL = dict(num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4, block_size=4)


@pytest.fixture(scope="module")
def tiny(model_dirs) -> str:
    return str(model_dirs("llama"))


@pytest.fixture(scope="module")
def proposers(model_dirs, tiny) -> dict[str, dict]:
    other = str(model_dirs("llama", seed=1))
    return {
        "draft_model seed 1": {
            "method": "draft_model",
            "model": other,
            "num_speculative_tokens": 3,
        },
        "draft_model itself": {"method": "draft_model", "model": tiny, "num_speculative_tokens": 4},
        "self_draft": {"method": "self_draft", "num_draft_layers": 1, "num_speculative_tokens": 4},
    }


def run(tiny, prompts, params, spec, **kw):
    with LLM(model=tiny, speculative_config=spec, **kw) as llm:
        results = llm.generate(prompts, params)
        stats = llm.engine.stats()
        assert stats["kv_blocks_used"] == 0, stats
    return results, stats


@pytest.mark.parametrize("name", ["draft_model seed 1", "draft_model itself", "self_draft"])
def test_greedy_outputs_are_ordinary_decodes_for_every_model_proposer(tiny, proposers, name):
    spec = proposers[name]
    itself = name == "draft_model itself"
    cases = [
        (SamplingParams(max_tokens=40, temperature=0.0), {}),
        # Chunked prefill beside verifying decodes, preemption and recomputation, n > 1.
        (SamplingParams(max_tokens=40, temperature=0.0, n=2), SMALL),
        # max_tokens cut inside an accepted run; logprobs of the committed tokens.
        (SamplingParams(max_tokens=23, temperature=0.0, logprobs=2, min_tokens=3), {}),
    ]
    for params, kw in cases:
        off, _ = run(tiny, PROMPTS, params, None, **kw)
        on, stats = run(tiny, PROMPTS, params, spec, **kw)
        assert tokens(on) == tokens(off), (name, kw)
        assert stats["spec_proposed_tokens"] > 0
        if kw:
            assert stats["num_preemptions"] > 0
        if itself:  # the draft's cache is exact: every drafted token is the target's
            assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"]
        if params.logprobs:
            assert_same_committed(on, off, 23)
    stop_text = off[0].outputs[0].text[5:9]
    params = SamplingParams(max_tokens=40, temperature=0.0, stop=[stop_text])
    off, _ = run(tiny, PROMPTS[:1], params, None)
    on, _ = run(tiny, PROMPTS[:1], params, spec)
    assert on[0].outputs[0].text == off[0].outputs[0].text
    assert on[0].outputs[0].finish_reason == "stop"


def residual_from_p(draft, q, p, targets, generator_for):
    """A test double of a wrong rule: on rejection, a draw from p itself (not max(0, p - q))."""
    d = draft[0]
    if float(torch.rand((), generator=generator_for(2, 0))) * float(q[0, d]) < float(p[0, d]):
        return [d, targets[1]]
    return [race(p[0], generator_for(3, 0))]


def rule_samples(rule, num: int, seed: int) -> tuple[Counter, int]:
    """The first committed token over `num` drafts drawn from q, verified against p."""
    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04]])
    q = torch.tensor([[0.10, 0.05, 0.35, 0.30, 0.15, 0.05]])
    gen = torch.Generator().manual_seed(seed)
    counts: Counter = Counter()
    accepted = 0
    for _ in range(num):
        d = int(torch.multinomial(q[0], 1, generator=gen))
        bonus = int(torch.multinomial(p[0], 1, generator=gen))
        kept = rule([d], q, p, [0, bonus], lambda stream, i: gen)
        counts[kept[0]] += 1
        accepted += len(kept) == 2
    return counts, accepted


def test_rejection_rule_gives_the_target_distribution_and_a_wrong_rule_is_caught():
    num = 20_000
    p = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
    direct = Counter(torch.multinomial(p, num, replacement=True).tolist())
    counts, accepted = rule_samples(accept_sampled, num, seed=3)
    # Acceptance is sum(min(p, q)) = 0.5 on these two: both branches carry mass.
    assert 0.45 * num < accepted < 0.55 * num
    assert not chi_square_p_below_001(counts, direct)
    wrong, _ = rule_samples(residual_from_p, num, seed=3)
    assert chi_square_p_below_001(wrong, direct)


def test_rejection_rule_units():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]])
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    # p == q at a position: always kept; a draft token p forbids: never kept, and the
    # residual never draws it; a dead row (the grammar admits nothing) ends the run.
    for _ in range(20):
        kept = accept_sampled([1, 2], q, p, [1, 0, 7], lambda s, i: gen)
        assert kept[0] == 1 and kept[1] in (0, 1) and len(kept) == 2
    assert accept_sampled([1], q[:1], p[:1], [1, 9], lambda s, i: gen) == [1, 9]
    assert accept_sampled([1], q[:1], p[:1], [NO_TOKEN, 9], lambda s, i: gen) == [NO_TOKEN]


def test_a_seed_repeats_its_tokens_with_a_model_proposer(tiny, proposers):
    params = [
        SamplingParams(
            max_tokens=40, temperature=0.8, top_p=0.9, repetition_penalty=1.1, seed=i, n=2
        )
        for i in range(len(PROMPTS))
    ]
    for name in ("draft_model seed 1", "draft_model itself"):
        first, stats = run(tiny, PROMPTS, params, proposers[name], **SMALL)
        again, _ = run(tiny, PROMPTS, params, proposers[name], **SMALL)
        assert tokens(first) == tokens(again), name
        assert stats["num_preemptions"] > 0
    # Without penalties (which the draft does not apply) the target drafting for itself has q
    # equal to p, and rejection sampling keeps every drafted token.
    params = [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=i) for i in range(4)]
    _, stats = run(tiny, PROMPTS, params, proposers["draft_model itself"])
    assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"] > 0


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
}
GRAMMARS = {
    "json_schema": lambda c: c.compile_json_schema(
        json.dumps(
            {
                "type": "object",
                "properties": {"a": {"type": "string", "maxLength": 12}, "b": {"enum": ["x", "y"]}},
                "required": ["a", "b"],
            }
        ),
        any_whitespace=False,
    ),
    "regex": lambda c: c.compile_regex(r"(cat|dog)-[0-9]{2,6}( (cat|dog)-[0-9]{2,6})*"),
    "ebnf": lambda c: c.compile_grammar(
        'root ::= "(" expr ")"\nexpr ::= num | num "+" expr\nnum ::= [0-9] | [1-9] [0-9]'
    ),
    "choice": lambda c: c.compile_regex(r"(yes|no|maybe)"),
    # The grammars the server builds for tool_choice="required" and for reasoning then JSON.
    "tool_choice=required": lambda c: c.compile_grammar(
        spec_ebnf(
            "tool_calls",
            json.dumps({"functions": [["get_weather", WEATHER]], "only_one": False}),
        )
    ),
    "reasoning then JSON": lambda c: c.compile_grammar(
        spec_ebnf(
            "after_reasoning",
            json.dumps(
                {
                    "inner": ["json_schema", json.dumps(WEATHER)],
                    "strict": True,
                    "starts_in_reasoning": False,
                }
            ),
        )
    ),
}


@pytest.fixture(scope="module")
def compiler(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=tokenizer.vocab_size)
    return tokenizer, xgr.GrammarCompiler(info)


def constrained(tiny, compiler, compiled, spec, params):
    tokenizer, _ = compiler
    with LLM(model=tiny, speculative_config=spec) as llm:
        engine = llm.engine
        for i, prompt in enumerate(PROMPTS):
            constraint = GrammarConstraint(compiled)
            engine.add_request(f"r{i}", tokenizer.encode(prompt), params, constraints=[constraint])
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
        while engine.has_unfinished():
            for o in engine.step():
                for d in o.deltas:
                    out[o.request_id].extend(d.token_ids)
        stats = engine.stats()
        assert stats["kv_blocks_used"] == 0
    return out, stats


def replays(compiled, token_ids) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return all(matcher.accept_token(t) for t in token_ids)


@pytest.mark.parametrize("proposer", ["ngram", "draft_model itself"])
@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_constrained_drafts_commit_only_what_the_grammar_allows(
    tiny, proposers, compiler, kind, proposer
):
    compiled = GRAMMARS[kind](compiler[1])
    # The target drafting for itself, unconstrained: its drafts leave the grammar wherever the
    # mask bites, and those tokens are rejected there.
    spec = NGRAM if proposer == "ngram" else proposers[proposer]
    greedy = SamplingParams(max_tokens=60, temperature=0.0)
    off, _ = constrained(tiny, compiler, compiled, None, greedy)
    on, stats = constrained(tiny, compiler, compiled, spec, greedy)
    assert on == off
    assert stats["spec_proposed_tokens"] > 0
    sampled = SamplingParams(max_tokens=60, temperature=1.0, seed=4)
    on, stats = constrained(tiny, compiler, compiled, spec, sampled)
    assert stats["spec_proposed_tokens"] > 0
    for ids in on.values():
        assert replays(compiled, ids), (kind, ids)


def test_model_proposer_config_is_checked(tiny, proposers):
    with pytest.raises(ValueError, match="model: the draft checkpoint is required"):
        SpeculativeConfig.from_dict({"method": "draft_model"})
    with pytest.raises(ValueError, match="num_draft_layers"):
        SpeculativeConfig.from_dict({"method": "self_draft"})
    with pytest.raises(ValueError, match="num_draft_layers"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_draft_layers": 2})
    with pytest.raises(ValueError, match="below the target's 2 layers"):
        LLM(model=tiny, speculative_config={"method": "self_draft", "num_draft_layers": 2})
    with pytest.raises(ValueError, match="no config.json"):
        LLM(model=tiny, speculative_config={"method": "draft_model", "model": "/nonexistent"})


@pytest.mark.ray
def test_tp2_model_drafts_match_tp1_ordinary_decode(ray_session, tiny, proposers):
    """Every rank drafts alike (their logits are all-gathered): at TP=2 the draft of the target
    itself is accepted whole, and greedy outputs are TP=1 ordinary decode's."""
    params = SamplingParams(max_tokens=24, temperature=0.0)
    off, _ = run(tiny, PROMPTS, params, None)
    for name in ("draft_model itself", "self_draft"):
        on, stats = run(tiny, PROMPTS, params, proposers[name], tensor_parallel_size=2)
        assert tokens(on) == tokens(off), name
        if name == "draft_model itself":
            assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"] > 0
    # Sampled, with rejections and residual draws on every rank's lockstep drafts.
    sampled = SamplingParams(max_tokens=24, temperature=0.9, seed=7)
    _, stats = run(tiny, PROMPTS, sampled, proposers["draft_model seed 1"], tensor_parallel_size=2)
    assert stats["spec_proposed_tokens"] > 0


def test_an_early_exit_through_every_layer_is_the_target(tiny):
    """`self_draft`'s model shares the target's parameters (nothing copied) and runs on its own
    attention backend and cache: through all the target's layers its logits are the target's."""
    from actors.config import CacheConfig, ModelConfig
    from actors.messages import ScheduledItem
    from actors.model_runner import ModelRunner
    from actors.parallel_state import ensure_single_rank_group
    from actors.spec_decode.draft import EarlyExit

    ensure_single_rank_group()
    config = ModelConfig.from_pretrained(tiny, dtype=torch.float32)
    cache = CacheConfig(block_size=4)
    device = torch.device("cpu")
    target = ModelRunner(config, cache, device)
    layers = config.num_layers
    draft = ModelRunner(
        config, cache, device, build=lambda backend: EarlyExit(target.model, layers, backend)
    )
    shared = {id(p) for p in target.model.parameters()}
    assert {id(p) for p in draft.model.parameters()} <= shared
    assert draft.backend is not target.backend
    for runner in (target, draft):
        runner.init_kv_cache(8)
    prompt = list(range(3, 12))
    items = [ScheduledItem("s", prompt, 0, [0, 1, 2], True)]
    torch.testing.assert_close(draft.last_logits(items), target.last_logits(items))
    step = [ScheduledItem("s", [5], len(prompt), [0, 1, 2], True)]
    torch.testing.assert_close(draft.last_logits(step), target.last_logits(step))


@pytest.mark.ray
def test_tp2_a_rank_holding_another_mask_buffer_stops_the_registration(ray_session, tiny):
    """Over Ray, as the engine registers its mask buffer at start: a rank that already holds
    another shape refuses, and the error that reaches the engine names both shapes."""
    from actors.config import CacheConfig, ModelConfig, ParallelConfig
    from actors.executor.ray_tp import RayExecutor
    from actors.mask_buffer import mask_shape

    config = ModelConfig.from_pretrained(tiny, dtype=torch.float32)
    executor = RayExecutor(config, CacheConfig(), ParallelConfig(tensor_parallel_size=2))
    try:
        executor.init_kv_cache(8)
        ray_session.get(executor.workers[1].register_vocab_mask_buffer.remote(5))
        want, held = mask_shape(8, config.vocab_size), mask_shape(5, config.vocab_size)
        with pytest.raises(Exception, match=rf"{re.escape(str(want))}.*{re.escape(str(held))}"):
            executor.register_vocab_mask_buffer(8)
    finally:
        executor.shutdown()
