"""TP=2 over Ray worker actors (gloo on CPU) against TP=1 in-process."""

from __future__ import annotations

import re

import pytest
import torch

from actors import LLM, SamplingParams
from actors.executor import ExecutorError

pytestmark = pytest.mark.ray

PROMPTS = [list(range(5, 5 + n)) for n in (1, 17, 40, 130)]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_tp2_matches_tp1(ray_session, model_dirs, arch):
    path = str(model_dirs(arch))
    tp1 = LLM(model=path).generate(PROMPTS, GREEDY)
    # A small budget and pool force chunked prefill and preemption on the TP=2 run.
    llm = LLM(
        model=path,
        tensor_parallel_size=2,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        num_kv_blocks=14,
        block_size=16,
    )
    try:
        tp2 = llm.generate(PROMPTS, GREEDY)
        assert llm.stats()["num_preemptions"] > 0
    finally:
        llm.shutdown()
    for a, b in zip(tp1, tp2, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            torch.tensor([lp.logprob for lp in b.logprobs]),
            torch.tensor([lp.logprob for lp in a.logprobs]),
            atol=1e-4,
            rtol=1e-4,
        )


def test_tp2_constrained_decode_matches_tp1(ray_session, model_dirs):
    """At TP>1 a constrained step goes out in two calls (the forward to every rank, then the
    masks to rank 0 once filled): the same grammar gives the same tokens as TP=1."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from actors.grammar_state import GrammarConstraint

    path = str(model_dirs("llama"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=tokenizer.vocab_size)
    grammar = xgr.GrammarCompiler(info).compile_regex(r"(cat|dog)-[0-9]{2,6}")
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=5)

    def texts(llm: LLM) -> tuple[list[str], list[GrammarConstraint]]:
        constraints = [GrammarConstraint(grammar) for _ in PROMPTS[:2]]
        engine = llm.engine
        got = {}
        for i, ids in enumerate(PROMPTS):
            c = [constraints[i]] if i < len(constraints) else None
            engine.add_request(f"c{i}", ids, params, constraints=c)
            got[f"c{i}"] = ""
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += "".join(d.text for d in out.deltas)
        return [got[f"c{i}"] for i in range(len(PROMPTS))], constraints

    with LLM(model=path) as tp1:
        expected, _ = texts(tp1)
    with LLM(model=path, tensor_parallel_size=2) as tp2:
        got, constraints = texts(tp2)
    assert got == expected
    assert all(re.fullmatch(r"(cat|dog)-[0-9]{2,6}", t) for t in got[:2]), got
    assert all(c.num_rejected == 0 for c in constraints)


def test_each_rank_holds_only_its_shard(ray_session, model_dirs):
    path = str(model_dirs("llama"))
    single = LLM(model=path, num_kv_blocks=64)
    (whole,) = single.engine.executor.shard_info()
    llm = LLM(model=path, tensor_parallel_size=2, num_kv_blocks=64)
    try:
        ranks = llm.engine.executor.shard_info()
    finally:
        llm.shutdown()
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["pid"] != ranks[1]["pid"]
    for name, shape in whole["shapes"].items():
        for r in ranks:
            got = r["shapes"][name]
            if "norm" in name:
                assert got == shape, name  # replicated
            elif "o_proj" in name or "down_proj" in name:
                assert got == (shape[0], shape[1] // 2), name  # split by input columns
            else:
                assert got == (shape[0] // 2, *shape[1:]), name  # split by output rows/vocab
    for r in ranks:
        # Norms are the only replicated weights, so each rank holds a bit over half.
        assert 0.5 * whole["param_bytes"] < r["param_bytes"] < 0.52 * whole["param_bytes"]
        assert r["kv_cache_bytes"] == whole["kv_cache_bytes"] // 2


@pytest.mark.parametrize(
    ("tp", "named"),
    [
        (3, "num_attention_heads (4)"),
        (8, "num_attention_heads (4)"),
        (3, "intermediate_size (128)"),
    ],
)
def test_bad_tp_degree_is_refused_at_startup(model_dirs, tp, named):
    pattern = rf"tensor_parallel_size \({tp}\) does not divide .*{re.escape(named)}"
    with pytest.raises(ValueError, match=pattern):
        LLM(model=str(model_dirs("llama")), tensor_parallel_size=tp)


def test_killed_worker_fails_requests_and_leaves_no_placement_group(ray_session, model_dirs):
    ray = ray_session
    llm = LLM(model=str(model_dirs("llama")), tensor_parallel_size=2)
    engine = llm.engine
    engine.add_request("victim", list(range(5, 60)), SamplingParams(max_tokens=200))
    engine.step()
    ray.kill(engine.executor.workers[1])
    outputs = []
    for _ in range(5):
        outputs += engine.step()
        if not engine.has_unfinished():
            break
    assert outputs and outputs[-1].finished and outputs[-1].error
    assert outputs[-1].deltas[0].finish_reason == "error"
    assert not engine.is_healthy()
    with pytest.raises(ExecutorError):
        llm.generate(["more"], SamplingParams(max_tokens=2))
    llm.shutdown()
    states = {pg["state"] for pg in ray.util.placement_group_table().values()}
    assert states <= {"REMOVED"}


def test_tp4_replicates_kv_heads_and_matches_tp1(ray_session, model_dirs):
    """tiny llama has 2 KV heads: at TP=4 each KV head lives on two ranks."""
    path = str(model_dirs("llama"))
    expected = LLM(model=path).generate(PROMPTS, GREEDY)
    llm = LLM(model=path, tensor_parallel_size=4)
    try:
        got = llm.generate(PROMPTS, GREEDY)
        ranks = llm.engine.executor.shard_info()
    finally:
        llm.shutdown()
    assert [a.token_ids for a in expected] == [b.token_ids for b in got]
    head_dim = 16
    for r in ranks:
        # 1 query head + 1 (replicated) K head + 1 V head per rank.
        assert r["shapes"]["model.layers.0.self_attn.qkv_proj.weight"] == (3 * head_dim, 64)
