"""Speculative decoding (prompt lookup): what a user sees is exactly what ordinary decode gives
— same tokens, same logprobs, same grammar, the same distribution when sampling — and no KV
block outlives its request or keeps a rejected position."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from actors import LLM, SamplingParams
from actors.grammar_state import GrammarConstraint
from actors.mask_buffer import VocabMaskBuffer, check_ranks_agree
from actors.spec_decode import NgramProposer, SpeculativeConfig, accept_draft

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
# Repetitive prompts, so the random tiny model's output gets drafts and some are accepted.
PROMPTS = [
    "a b c d a b c d a b c d a b",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "x = [1, 2, 3]; y = [1, 2, 3]; z = [1, 2,",
    "one two three one two three one",
]


@pytest.fixture(scope="module")
def tiny(model_dirs) -> str:
    return str(model_dirs("llama"))


def generate(tiny, prompts, params, spec, **kw):
    with LLM(model=tiny, speculative_config=spec, **kw) as llm:
        results = llm.generate(prompts, params)
        stats = llm.engine.stats()
        assert stats["kv_blocks_used"] == 0, stats
    return results, stats


def tokens(results):
    return [[o.token_ids for o in r.outputs] for r in results]


def test_greedy_outputs_are_identical_with_speculation_on_and_off(tiny):
    params = SamplingParams(max_tokens=48, temperature=0.0)
    off, _ = generate(tiny, PROMPTS, params, None)
    on, stats = generate(tiny, PROMPTS, params, NGRAM)
    assert tokens(on) == tokens(off)
    assert stats["spec_proposed_tokens"] > 0 and stats["spec_accepted_tokens"] > 0


def test_identical_under_chunked_prefill_preemption_and_n(tiny):
    # A few blocks and a small token budget: prompts prefill in chunks beside verifying decodes,
    # and sequences are preempted and recomputed.
    params = SamplingParams(max_tokens=40, temperature=0.0, n=2)
    kw = dict(num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4, block_size=4)
    off, off_stats = generate(tiny, PROMPTS, params, None, **kw)
    on, stats = generate(tiny, PROMPTS, params, NGRAM, **kw)
    assert tokens(on) == tokens(off)
    assert stats["num_preemptions"] > 0 and stats["spec_accepted_tokens"] > 0


def assert_same_committed(on, off, num_tokens: int) -> None:
    """Each first output: the same `num_tokens` tokens, logprob ranks, logprobs (1e-4)."""
    for a, b in zip(on, off, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids and len(x.token_ids) == num_tokens
        assert [lp.rank for lp in x.logprobs] == [lp.rank for lp in y.logprobs]
        for p, q in zip(x.logprobs, y.logprobs, strict=True):
            assert p.logprob == pytest.approx(q.logprob, abs=1e-4)


def test_logprobs_stops_and_max_tokens_see_only_committed_tokens(tiny):
    params = SamplingParams(max_tokens=23, temperature=0.0, logprobs=2, min_tokens=3)
    off, _ = generate(tiny, PROMPTS, params, None)
    on, stats = generate(tiny, PROMPTS, params, NGRAM)
    assert stats["spec_accepted_tokens"] > 0
    assert_same_committed(on, off, 23)  # cut inside a run
    # A stop string that lands inside an accepted run cuts the text there.
    stop_text = off[0].outputs[0].text[5:9]
    params = SamplingParams(max_tokens=40, temperature=0.0, stop=[stop_text])
    off, _ = generate(tiny, PROMPTS[:1], params, None)
    on, _ = generate(tiny, PROMPTS[:1], params, NGRAM)
    assert on[0].outputs[0].text == off[0].outputs[0].text
    assert on[0].outputs[0].finish_reason == off[0].outputs[0].finish_reason == "stop"


class OracleProposer:
    """A test double: drafts the continuation a run without speculation produced (found by
    the prompt and the output so far), with its last token wrong, so every draft has both
    accepted and rejected positions."""

    name = "oracle"

    def __init__(self, results):
        self.futures = [(r.prompt_token_ids, o.token_ids) for r in results for o in r.outputs]

    def propose(self, seq, k):
        done = seq.output_token_ids
        for prompt, out in self.futures:
            if prompt == seq.prompt_token_ids and out[: len(done)] == done:
                draft = out[len(done) : len(done) + k]
                return draft[:-1] + [(draft[-1] + 1) % 100] if len(draft) > 1 else []
        return []


def test_seeded_sampling_commits_what_it_would_without_speculation(tiny):
    # Each position draws the noise ordinary decode would, so a seed gives the same tokens
    # with speculation on and off, under penalties and filters, with n > 1 and preemption.
    params = [
        SamplingParams(
            max_tokens=40, temperature=0.8, top_p=0.9, repetition_penalty=1.1, seed=i, n=2
        )
        for i in range(len(PROMPTS))
    ]
    with LLM(model=tiny) as llm:
        off = llm.generate(PROMPTS, params)
    kw = dict(num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4, block_size=4)
    with LLM(model=tiny, speculative_config=NGRAM, **kw) as llm:
        llm.engine.proposer = OracleProposer(off)
        on = llm.generate(PROMPTS, params)
        stats = llm.engine.stats()
        assert stats["kv_blocks_used"] == 0
    assert tokens(on) == tokens(off)
    assert stats["spec_accepted_tokens"] > stats["spec_drafts"] > 0
    assert stats["num_preemptions"] > 0


class FixedProposer:
    """A test double: proposes the same tokens for every sequence."""

    name = "fixed"

    def __init__(self, draft: list[int]):
        self.draft = draft

    def propose(self, seq, k):
        return self.draft[:k]


def biased_acceptance(draft, targets):
    """A test double of a wrong acceptance rule: the first draft token always goes in."""
    return draft[:1] + accept_draft(draft[1:], targets[1:])


def sample_positions(tiny, num, spec=None, proposer=None, seed=0):
    """Counters of the tokens at output positions 1..3 over `num` unseeded samples (the
    engine's own generator is seeded, so a run is reproducible)."""
    params = SamplingParams(max_tokens=4, temperature=0.4, ignore_eos=True)
    with LLM(model=tiny, speculative_config=spec, max_num_seqs=256, seed=seed) as llm:
        if proposer is not None:
            llm.engine.proposer = proposer
        results = []
        for _ in range(num // 1000):  # a bounded waiting queue per call
            results += llm.generate([PROMPTS[0]] * 1000, params)
        accepted = llm.engine.stats()["spec_accepted_tokens"]
        assert llm.engine.stats()["kv_blocks_used"] == 0
    ids = [r.outputs[0].token_ids for r in results]
    return [Counter(t[pos] for t in ids) for pos in (1, 2, 3)], accepted


def chi_square_p_below_001(a: Counter, b: Counter) -> bool:
    """Two-sample chi-square test of homogeneity: True when a and b differ at p < 0.01.
    Tokens expected fewer than 5 times are pooled; the critical value is Wilson-Hilferty's."""
    na, nb = sum(a.values()), sum(b.values())
    pooled = a + b
    common = [t for t, c in pooled.items() if c * min(na, nb) / (na + nb) >= 5]
    cells = [(a[t], b[t]) for t in common]
    cells.append((na - sum(x for x, _ in cells), nb - sum(y for _, y in cells)))
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            if expected:
                stat += (observed - expected) ** 2 / expected
    df = len(cells) - 1
    z = 2.3263  # the upper 1% point of the standard normal
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > critical


@pytest.fixture(scope="module")
def unspeculated(tiny) -> list[Counter]:
    """20,000 samples without speculation: the reference both distribution tests compare to."""
    return sample_positions(tiny, 20_000)[0]


def test_sampled_distribution_is_unchanged_by_speculation(tiny, unspeculated, monkeypatch):
    num = 20_000
    off = unspeculated
    # Draft the likeliest tokens at positions 1 and 2, so both acceptance and rejection (with
    # the residual draw) carry real mass.
    draft = [off[0].most_common(1)[0][0], off[1].most_common(1)[0][0]]
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    on, accepted = sample_positions(tiny, num, spec, FixedProposer(draft), seed=1)
    assert accepted > num // 10
    for a, b in zip(on, off, strict=True):
        assert not chi_square_p_below_001(a, b)
    # The same test catches a rule that commits the draft's first token unconditionally.
    import actors.spec_decode.verify

    monkeypatch.setattr(actors.spec_decode.verify, "accept_draft", biased_acceptance)
    biased, _ = sample_positions(tiny, num // 4, spec, FixedProposer(draft), seed=1)
    assert chi_square_p_below_001(biased[0], off[0])


def test_sampled_distribution_with_a_draft_model_is_the_targets(
    tiny, model_dirs, unspeculated, monkeypatch
):
    # Another random checkpoint drafts from its own q; rejection sampling against it keeps the
    # target's distribution (the rule itself: tests/engine/test_model_proposers.py).
    other = str(model_dirs("llama", seed=1))
    spec = {"method": "draft_model", "model": other, "num_speculative_tokens": 2}
    # 10,000 against the 20,000-sample reference: the rule itself is tested over 20,000 draws
    # in test_model_proposers.py, and a draft model's step costs more than prompt lookup's.
    num = 10_000
    on, accepted = sample_positions(tiny, num, spec, seed=1)
    assert accepted > num // 20  # both kept drafts and residual draws carry mass
    for a, b in zip(on, unspeculated, strict=True):
        assert not chi_square_p_below_001(a, b)


@pytest.fixture(scope="module")
def grammar(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=tokenizer.vocab_size)
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"a": {"type": "string", "maxLength": 12}, "b": {"enum": ["x", "y"]}},
            "required": ["a", "b"],
        }
    )
    compiled = xgr.GrammarCompiler(info).compile_json_schema(schema, any_whitespace=False)
    return tokenizer, compiled


def run_constrained(tiny, grammar, spec, proposer=None):
    tokenizer, compiled = grammar
    params = SamplingParams(max_tokens=60, temperature=0.0)
    with LLM(model=tiny, speculative_config=spec) as llm:
        engine = llm.engine
        if proposer is not None:
            engine.proposer = proposer
        constraints = {}
        for i, prompt in enumerate(PROMPTS):
            c = GrammarConstraint(compiled)
            constraints[f"r{i}"] = c
            engine.add_request(f"r{i}", tokenizer.encode(prompt), params, constraints=[c])
        out = {f"r{i}": [] for i in range(len(PROMPTS))}
        while engine.has_unfinished():
            for o in engine.step():
                for d in o.deltas:
                    out[o.request_id].extend(d.token_ids)
        assert engine.stats()["kv_blocks_used"] == 0
        rejected = sum(c.num_rejected for c in constraints.values())
        return out, engine.stats(), rejected


def replays(compiled, token_ids) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return all(matcher.accept_token(t) for t in token_ids)


def test_constrained_outputs_identical_and_every_output_replays(tiny, grammar):
    off, _, _ = run_constrained(tiny, grammar, None)
    on, stats, rejected = run_constrained(tiny, grammar, NGRAM)
    assert on == off
    assert stats["spec_proposed_tokens"] > 0 and rejected == 0
    for ids in on.values():
        assert replays(grammar[1], ids)


class IllegalProposer:
    """A test double: proposes the committed tokens' likely continuation with an illegal token
    (one the grammar never allows: a raw newline inside compact JSON) at position 2."""

    name = "illegal"

    def __init__(self, bad: int):
        self.bad = bad
        self.inner = NgramProposer(1, 3)

    def propose(self, seq, k):
        draft = (self.inner.propose(seq, k) + [seq.token_ids[-1]] * k)[:k]
        if len(draft) > 2:
            draft[2] = self.bad
        return draft


def test_a_proposer_of_illegal_tokens_never_gets_one_committed(tiny, grammar):
    tokenizer, compiled = grammar
    bad = tokenizer.convert_tokens_to_ids(tokenizer.tokenize("\n"))[0]
    off, _, _ = run_constrained(tiny, grammar, None)
    on, stats, rejected = run_constrained(tiny, grammar, NGRAM, IllegalProposer(bad))
    assert on == off and rejected == 0
    assert stats["spec_proposed_tokens"] > 0
    for ids in on.values():
        assert bad not in ids and replays(compiled, ids)


class PastTheEndProposer:
    """A test double: drafts what a run without speculation produced next, through its last
    token (the grammar's stop token) and on past it, so drafts cross the grammar's end."""

    name = "past-the-end"

    def __init__(self, outputs: dict[str, list[int]], prompts: list[list[int]]):
        self.futures = [(prompts[i], outputs[f"r{i}"]) for i in range(len(prompts))]

    def propose(self, seq, k):
        done = seq.output_token_ids
        for prompt, out in self.futures:
            if prompt == seq.prompt_token_ids and out[: len(done)] == done:
                return (out[len(done) :] + [out[-1]] * k)[:k]
        return []


def test_a_draft_past_the_grammars_end_stops_there(tiny, grammar):
    tokenizer, compiled = grammar
    off, _, _ = run_constrained(tiny, grammar, None)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    on, stats, rejected = run_constrained(tiny, grammar, NGRAM, PastTheEndProposer(off, prompts))
    assert on == off and rejected == 0
    assert stats["spec_accepted_tokens"] > 0
    for ids in on.values():
        assert replays(compiled, ids)


def test_prefix_cache_reuse_is_unaffected_by_rolled_back_tokens(tiny):
    params = SamplingParams(max_tokens=40, temperature=0.0)
    with LLM(model=tiny, speculative_config=NGRAM, block_size=4) as llm:
        first = llm.generate(PROMPTS[:1], params)[0]
        # The prompt plus the output: its cached blocks hold only committed tokens' KV.
        again = llm.generate([first.prompt_token_ids + first.outputs[0].token_ids[:-1]], params)
        fresh = None
    with LLM(model=tiny, block_size=4, enable_prefix_caching=False) as llm:
        fresh = llm.generate([first.prompt_token_ids + first.outputs[0].token_ids[:-1]], params)
    assert again[0].num_cached_tokens > len(first.prompt_token_ids)
    assert again[0].outputs[0].token_ids == fresh[0].outputs[0].token_ids


def test_acceptance_and_lookup_units():
    assert accept_draft([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_draft([5, 6], [5, 6, 8]) == [5, 6, 8]
    assert accept_draft([5], [4, 0]) == [4]

    class Seq:
        token_ids = [1, 2, 3, 9, 1, 2, 3, 7, 1, 2]
        proposer_state = None

    seq = Seq()
    # The latest earlier occurrence of the longest matching suffix ("1 2" -> then "3 7").
    assert NgramProposer(1, 3).propose(seq, 2) == [3, 7]
    seq.token_ids.append(3)
    assert NgramProposer(1, 3).propose(seq, 3) == [7, 1, 2]
    assert (
        NgramProposer(2, 3).propose(
            type("S", (), {"token_ids": [4, 5], "proposer_state": None})(), 3
        )
        == []
    )


def test_speculative_config_is_checked():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown key"):
        SpeculativeConfig.from_dict({"method": "ngram", "k": 3})
    with pytest.raises(ValueError, match="not one of ngram, draft_model, self_draft"):
        SpeculativeConfig.from_dict({"method": "medusa"})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig.from_dict({"prompt_lookup_min": 4, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match="min_acceptance_rate"):
        SpeculativeConfig.from_dict({"min_acceptance_rate": 1.5})


def test_mask_buffer_is_registered_once_and_validated():
    buf = VocabMaskBuffer(100, "cpu")
    assert buf.register(8) == (8, 4)
    assert buf.register(8) == (8, 4)  # the same registration is fine
    with pytest.raises(ValueError, match=r"\(12, 4\).*\(8, 4\)"):
        buf.register(12)
    import torch

    with pytest.raises(ValueError, match="int64"):
        buf.register(8, dtype=torch.int64)
    tensor = buf.tensor
    with pytest.raises(ValueError, match="do not fit"):
        buf.load(torch.zeros(9, 4, dtype=torch.int32))
    masks = torch.zeros(3, 4, dtype=torch.int32)
    assert buf.load(masks).data_ptr() == tensor.data_ptr() and buf.tensor is tensor
    assert not bool(tensor[:3].any())
    check_ranks_agree([(8, 4), (8, 4)])
    with pytest.raises(
        ValueError, match=r"rank 1 registered \(8, 5\) but rank 0 registered \(8, 4\)"
    ):
        check_ranks_agree([(8, 4), (8, 5)])


def test_engine_registers_rows_for_every_verified_position(tiny):
    with LLM(model=tiny, speculative_config=NGRAM, max_num_seqs=8) as llm:
        runner = llm.engine.executor.worker.runner
        assert tuple(runner.mask_buffer.tensor.shape)[0] == 8 * 5
        assert llm.engine.masks.buffer.shape[0] == 8 * 5
        with pytest.raises(ValueError, match="re-registered"):
            runner.register_vocab_mask_buffer(8)


def test_the_server_takes_the_same_dict_from_config_and_command_line(tiny):
    from pydantic import ValidationError

    from serve_app.cli import build_parser, serve_config_from_args

    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            tiny,
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3}',
        ]
    )
    config = serve_config_from_args(args)
    assert config.engine.speculative_config == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
        "min_acceptance_rate": 0.3,
    }
    args = build_parser().parse_args(
        ["serve", "--model", tiny, "--speculative-config", '{"method": "ngram", "k": 3}']
    )
    with pytest.raises(ValidationError, match="unknown key"):
        serve_config_from_args(args)


def test_back_off_pauses_a_failing_sequence_and_probes_again():
    from actors.spec_decode import Backoff

    b = Backoff(0.3)
    for _ in range(7):
        b.record(4, 1)
    assert b.may_propose()  # 28 proposed tokens are not yet a window
    b.record(4, 0)  # 7 of the last 32 accepted: pause for 16 steps
    assert [b.may_propose() for _ in range(17)] == [False] * 16 + [True]
    b.record(8, 0)  # the probe fails (5 of the last 32): the pause doubles
    assert sum(not b.may_propose() for _ in range(40)) == 32
    b.record(32, 24)  # a passing window resets the pause
    assert b.may_propose() and b.pause == 16


def test_non_repetitive_traffic_stops_paying_for_drafts(tiny):
    # Random prompts and a random model: drafts are almost never accepted, so with back-off
    # each sequence proposes a little and then mostly probes; without it, nearly every step.
    import random

    rng = random.Random(0)
    prompts = [" ".join(str(rng.randrange(1000)) for _ in range(30)) for _ in range(4)]
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    calls = []
    base = {**NGRAM, "prompt_lookup_min": 1}
    stats = {}
    for rate in (0.0, 0.3):
        with LLM(model=tiny, speculative_config={**base, "min_acceptance_rate": rate}) as llm:
            llm.engine.on_draft_verified = lambda name, p, a: calls.append((name, p, a))
            llm.generate(prompts, params)
            stats[rate] = llm.engine.stats()
    drafts_off, drafts_on = stats[0.0]["spec_drafts"], stats[0.3]["spec_drafts"]
    assert drafts_on < drafts_off / 2, (drafts_on, drafts_off)
    # The hook saw every verified draft, named by its proposer.
    assert len(calls) == drafts_off + drafts_on
    assert {c[0] for c in calls} == {"ngram"}
    assert sum(c[1] for c in calls) == sum(s["spec_proposed_tokens"] for s in stats.values())


def test_speculation_metrics_are_exported_per_proposer(ray_session):
    import time

    import httpx
    import ray

    @ray.remote
    def verified_drafts() -> None:
        from serve_app.metrics import record_speculation

        for proposed, accepted in ((4, 4), (4, 0), (3, 2)):
            record_speculation("ngram", proposed, accepted)

    ray.get(verified_drafts.remote())
    node = ray_session._private.worker.global_worker.node
    url = f"http://127.0.0.1:{node.metrics_export_port}/metrics"
    wanted = {
        "serve_app_spec_proposed_tokens_total": 11.0,
        "serve_app_spec_accepted_tokens_total": 6.0,
        "serve_app_spec_acceptance_length_count": 3.0,
    }
    deadline = time.monotonic() + 60
    while True:
        seen = {}
        lines = [x for x in httpx.get(url, timeout=10).text.splitlines() if "serve_app_spec" in x]
        for line in lines:
            name = line.split("{", 1)[0].removeprefix("ray_")
            if name in wanted and 'proposer="ngram"' in line:
                seen[name] = seen.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        if seen == wanted:
            break
        assert time.monotonic() < deadline, f"exported {lines}, wanted {wanted}"
        time.sleep(1)
