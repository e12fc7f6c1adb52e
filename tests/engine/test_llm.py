"""The offline facade and engine behaviour a user sees: samples, seeds, stops, abort, hold."""

from __future__ import annotations

import re

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from actors import LLM, SamplingParams
from actors.grammar_state import GrammarConstraint


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model=str(model_dirs("llama")))


def _drain(engine, request_id):
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def test_seeded_sampling_is_independent_of_batch_mates(llm):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    alone = llm.generate(["The quick brown fox"], params)[0]
    mates = SamplingParams(max_tokens=30, temperature=0.9, ignore_eos=True)
    batch = llm.generate(
        ["Some other prompt", "The quick brown fox", "x = [1, 2, 3]"], [mates, params, mates]
    )
    assert batch[1].token_ids == alone.token_ids
    other_seed = SamplingParams(max_tokens=24, temperature=1.0, seed=8, ignore_eos=True)
    assert llm.generate(["The quick brown fox"], other_seed)[0].token_ids != alone.token_ids


def test_n_samples_share_the_prompt_and_differ(llm):
    prompt = list(range(100, 160))
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    result = llm.generate([prompt], params)[0]
    assert [o.index for o in result.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 12 for o in result.outputs)
    assert len({tuple(o.token_ids) for o in result.outputs}) == 3
    again = llm.generate([prompt], params)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in result.outputs]
    assert llm.stats()["kv_blocks_used"] == 0


def test_stop_string_truncates_and_reports_the_match(llm):
    base = llm.generate(["Once upon a time"], SamplingParams(max_tokens=30, temperature=0))[0]
    # Choose a stop string from inside the greedy text, spanning a token boundary.
    text = base.text
    assert len(text) > 8
    stop = text[5:9]
    out = llm.generate(
        ["Once upon a time"], SamplingParams(max_tokens=30, temperature=0, stop=stop)
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    kept = llm.generate(
        ["Once upon a time"],
        SamplingParams(max_tokens=30, temperature=0, stop=stop, include_stop_str_in_output=True),
    )[0]
    assert kept.text == text[: text.find(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens(llm):
    base = llm.generate(["abc"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 10
    stop_id = base.token_ids[3]
    out = llm.generate(
        ["abc"], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_id])
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", {}, "prompt"),
        ([], {}, "prompt"),
        ([5, 999_999], {}, "prompt_token_ids"),
        ([5] * 1024, {}, "prompt"),
        ("hi", {"max_tokens": 0}, "max_tokens"),
        ("hi", {"bogus": 1}, "bogus"),
        ("hi", {"top_p": 0.0}, "top_p"),
    ],
)
def test_bad_input_raises_value_error_naming_the_field(llm, prompt, params, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate([prompt], params)


def test_abort_frees_blocks_by_the_next_step(llm):
    engine = llm.engine
    engine.add_request("abort-me", list(range(20, 90)), SamplingParams(max_tokens=100))
    for _ in range(3):
        engine.step()
    assert engine.stats()["kv_blocks_used"] > 0
    engine.abort("abort-me")
    engine.abort("abort-me")  # a second abort (and an unknown id) is a no-op
    engine.abort("never-existed")
    outputs = _drain(engine, "abort-me")
    assert outputs[-1].finished and outputs[-1].deltas[0].finish_reason == "abort"
    assert engine.stats()["kv_blocks_used"] == 0 and engine.stats()["live_requests"] == 0


def test_stats_count_the_steps_run(llm):
    """`steps_total` (the admin API's per-replica stats) counts every step: one request of n
    tokens takes its prefill step, then one decode step per further token."""
    engine = llm.engine
    before = engine.stats()["steps_total"]
    engine.add_request("counted", list(range(20, 40)), SamplingParams(max_tokens=5))
    _drain(engine, "counted")
    assert engine.stats()["steps_total"] == before + 5
    engine.step()  # nothing to run: not a step
    assert engine.stats()["steps_total"] == before + 5


def test_held_request_keeps_kv_and_resumes(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = llm.generate([list(range(30, 50))], params)[0].token_ids
    engine.add_request("held", list(range(30, 50)), params)
    engine.step()
    engine.hold("held")
    used = engine.stats()["kv_blocks_used"]
    for _ in range(3):
        assert engine.step() == []
    assert engine.stats()["held"] == 1 and engine.stats()["kv_blocks_used"] == used
    engine.resume("held")
    tokens = [t for o in _drain(engine, "held") for d in o.deltas for t in d.token_ids]
    # The first token came before the hold.
    assert len(tokens) == 5 and tokens == expected[1:]


def test_grammar_bitmask_constrains_decode(llm, model_dirs):
    tokenizer = AutoTokenizer.from_pretrained(model_dirs("llama"))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=llm.model_config.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_regex(r"(cat|dog)-[0-9]{2,4}")
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1)
    constraint = GrammarConstraint(compiled)
    engine.add_request("g", tokenizer.encode("pet:"), params, constraints=[constraint])
    outputs = _drain(engine, "g")
    text = "".join(d.text for o in outputs for d in o.deltas)
    assert re.fullmatch(r"(cat|dog)-[0-9]{2,4}", text), text
    assert outputs[-1].deltas[-1].finish_reason == "stop"
    assert constraint.num_rejected == 0
