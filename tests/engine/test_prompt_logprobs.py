"""Prompt logprobs against transformers on tiny fp32 checkpoints: whole, chunked, preempted,
and behind a prefix-cache hit."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors import LLM, SamplingParams
from actors.outputs import GenerationResult

pytestmark = pytest.mark.parity

ARCHS = ["llama", "qwen2", "mistral"]
# Lengths straddle block boundaries (16) and, for mistral, its 64-token sliding window.
PROMPT_LENGTHS = [1, 2, 7, 16, 33, 70, 150]
TOP_K = 5


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(4321)
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=ARCHS)
def arch_setup(request, model_dirs):
    path = model_dirs(request.param)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, str(path), hf


def _hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """(len(prompt), vocab): row i - 1 scores prompt token i."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _assert_matches(hf, prompt: list[int], result: GenerationResult, k: int, where: str) -> None:
    ours = result.prompt_logprobs
    assert ours is not None and len(ours) == len(prompt), where
    assert ours[0] is None, f"{where}: the first prompt token has no logprob"
    if len(prompt) == 1:
        return
    ref = _hf_prompt_logprobs(hf, prompt)[:-1]
    targets = torch.tensor(prompt[1:])
    expected = ref.gather(1, targets.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in ours[1:]]), expected)
    ranks = (ref > expected.unsqueeze(1)).sum(dim=-1) + 1
    assert [lp.rank for lp in ours[1:]] == ranks.tolist(), where
    if k:
        values, ids = ref.topk(k, dim=-1)
        assert [[t for t, _ in lp.top] for lp in ours[1:]] == ids.tolist(), where
        ours_values = torch.tensor([[v for _, v in lp.top] for lp in ours[1:]])
        torch.testing.assert_close(ours_values, values)
    else:
        assert all(lp.top == [] for lp in ours[1:]), where


def test_prompt_logprobs_match_transformers(arch_setup):
    arch, path, hf = arch_setup
    llm = LLM(model=path)
    prompts = _prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP_K)
    for prompt, result in zip(prompts, llm.generate(prompts, params), strict=True):
        _assert_matches(hf, prompt, result, TOP_K, f"{arch}: {len(prompt)} tokens")
    # k = 0: the prompt token's own logprob and rank, no alternatives.
    alone = llm.generate([prompts[3]], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    _assert_matches(hf, prompts[3], alone, 0, f"{arch}: k=0")
    # Without the parameter nothing is computed (and nothing is reported).
    assert llm.generate([prompts[3]], SamplingParams(max_tokens=1))[0].prompt_logprobs is None
    assert llm.stats()["kv_blocks_used"] == 0


def test_chunked_prefill_and_preemption_report_each_position_once(arch_setup):
    arch, path, hf = arch_setup
    # A 48-token step budget splits every longer prompt over several steps; 14 blocks of 16
    # cannot hold all the sequences at once, so some are preempted and recomputed.
    llm = LLM(
        model=path, max_num_seqs=8, max_num_batched_tokens=48, num_kv_blocks=14, block_size=16
    )
    prompts = _prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    results = llm.generate(prompts, params)
    assert llm.stats()["num_preemptions"] > 0, "the setup should have forced preemption"
    for prompt, result in zip(prompts, results, strict=True):
        _assert_matches(hf, prompt, result, 3, f"{arch}: chunked, {len(prompt)} tokens")
    assert llm.stats()["kv_blocks_used"] == 0


def test_a_cached_prefix_is_recomputed_for_its_logprobs(arch_setup):
    arch, path, hf = arch_setup
    llm = LLM(model=path, block_size=16)
    prompt = _prompts(hf.config.vocab_size)[-2]  # 70 tokens: 4 full blocks
    plain = SamplingParams(max_tokens=1, temperature=0.0)
    assert llm.generate([prompt], plain)[0].num_cached_tokens == 0
    # The prefix is cached now; a request for its logprobs recomputes it instead of reusing.
    asking = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOP_K)
    longer = prompt + prompt[:9]
    result = llm.generate([longer], asking)[0]
    assert result.num_cached_tokens == 0
    _assert_matches(hf, longer, result, TOP_K, f"{arch}: behind a cached prefix")
    # Its own blocks still populate the cache for requests that do not ask.
    assert llm.generate([longer], plain)[0].num_cached_tokens == 64
    # n > 1: sample 0 scores the prompt, the others share its blocks.
    both = llm.generate([prompt], SamplingParams(n=2, max_tokens=3, prompt_logprobs=1))[0]
    _assert_matches(hf, prompt, both, 1, f"{arch}: n=2")
    assert [len(o.token_ids) for o in both.outputs] == [3, 3]
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.ray
def test_tensor_parallel_ranks_score_the_prompt_as_one(ray_session, model_dirs):
    """TP=2: every rank runs the LM head over the prompt rows (its vocab shard is gathered),
    and a chunked prefill still reports each position once."""
    path = str(model_dirs("llama"))
    prompts = [list(range(5, 5 + n)) for n in (1, 40, 130)]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP_K)
    expected = LLM(model=path).generate(prompts, params)
    llm = LLM(model=path, tensor_parallel_size=2, max_num_seqs=4, max_num_batched_tokens=32)
    try:
        got = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    for a, b in zip(expected, got, strict=True):
        assert b.prompt_logprobs[0] is None and len(b.prompt_logprobs) == len(a.prompt_logprobs)
        ours, ref = b.prompt_logprobs[1:], a.prompt_logprobs[1:]
        assert [[t for t, _ in lp.top] for lp in ours] == [[t for t, _ in lp.top] for lp in ref]
        close = {"atol": 1e-4, "rtol": 1e-4}
        chosen = [torch.tensor([lp.logprob for lp in x]) for x in (ours, ref)]
        torch.testing.assert_close(*chosen, **close)
        tops = [torch.tensor([[v for _, v in lp.top] for lp in x]) for x in (ours, ref)]
        torch.testing.assert_close(*tops, **close)
