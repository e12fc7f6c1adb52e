"""Our engine against transformers on tiny fp32 checkpoints: logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from actors import LLM, SamplingParams

pytestmark = pytest.mark.parity

ARCHS = ["llama", "qwen2", "mistral"]
# Lengths straddle block boundaries (16) and, for mistral, its 64-token sliding window.
PROMPT_LENGTHS = [1, 7, 16, 33, 70, 150]
NUM_NEW = 20


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=ARCHS)
def arch_setup(request, model_dirs):
    path = model_dirs(request.param)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, str(path), hf


def _hf_greedy(hf, prompt: list[int], num_new: int) -> list[int]:
    config = GenerationConfig(
        max_new_tokens=num_new, do_sample=False, eos_token_id=None, pad_token_id=2
    )
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt) :].tolist()


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def test_greedy_tokens_and_logprobs_match_transformers(arch_setup):
    arch, path, hf = arch_setup
    llm = LLM(model=path)
    prompts = _prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True, logprobs=5)
    # Each prompt alone (no batch mates), then all together in one continuous batch.
    alone = [llm.generate([p], params)[0] for p in prompts]
    together = llm.generate(prompts, params)
    for prompt, one, batched in zip(prompts, alone, together, strict=True):
        expected = _hf_greedy(hf, prompt, NUM_NEW)
        assert one.token_ids == expected, f"{arch}: prompt of {len(prompt)} tokens"
        assert batched.token_ids == expected, f"{arch}: batched prompt of {len(prompt)}"
        ref = _hf_logprobs(hf, prompt + expected)
        for i, lp in enumerate(one.logprobs):
            row = ref[len(prompt) - 1 + i]
            # The chosen token's logprob, then the top-5 alternatives, as transformers has them.
            torch.testing.assert_close(lp.logprob, row[expected[i]].item(), atol=1e-4, rtol=1e-4)
            values, ids = row.topk(5)
            assert [t for t, _ in lp.top] == ids.tolist()
            torch.testing.assert_close(
                torch.tensor([v for _, v in lp.top]), values, atol=1e-4, rtol=1e-4
            )
    assert llm.stats()["kv_blocks_used"] == 0


def test_chunked_prefill_and_preemption_keep_outputs_identical(arch_setup):
    arch, path, hf = arch_setup
    # A small step budget forces chunked prefill; 20 blocks of 16 tokens cannot hold all six
    # sequences at once, so the scheduler must preempt and recompute.
    llm = LLM(
        model=path, max_num_seqs=8, max_num_batched_tokens=48, num_kv_blocks=20, block_size=16
    )
    prompts = _prompts(hf.config.vocab_size)
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0, "the setup should have forced preemption"
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.token_ids == _hf_greedy(hf, prompt, NUM_NEW), f"{arch}: {len(prompt)} tokens"
        assert out.finish_reason == "length"
    assert stats["kv_blocks_used"] == 0


def test_prefix_cache_reuses_blocks_and_keeps_outputs(model_dirs):
    llm = LLM(model=str(model_dirs("llama")), block_size=16)
    prompt = list(range(10, 10 + 70))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cold = llm.generate([prompt], params)[0]
    warm = llm.generate([prompt], params)[0]
    assert cold.num_cached_tokens == 0
    # Full blocks of the prompt, leaving at least one token to compute: 69 // 16 * 16.
    assert warm.num_cached_tokens == 64
    assert warm.token_ids == cold.token_ids
    # A shared prefix with a different tail hits the shared blocks only.
    other = llm.generate([prompt[:40] + [7, 7, 7]], params)[0]
    assert other.num_cached_tokens == 32


def test_prefill_logits_match_transformers_at_every_position(arch_setup):
    """The paged path's full prefill logits (every position, whole vocab) against HF."""
    from actors.forward_context import set_forward_context
    from actors.messages import ScheduledItem

    arch, path, hf = arch_setup
    llm = LLM(model=path)
    runner = llm.engine.executor.worker.runner
    prompt = _prompts(hf.config.vocab_size)[-1]  # 150 tokens: crosses mistral's window
    # An idle engine: the first blocks are free to use for this one forward.
    table = list(range(llm.engine.block_manager.blocks_needed(len(prompt))))
    item = ScheduledItem("probe", prompt, 0, table, sample=True)
    input_ids, positions, meta, _, _ = runner._prepare([item])
    with torch.no_grad(), set_forward_context(meta):
        hidden = runner.model(input_ids, positions, runner.kv_caches)
    ours = runner.model.compute_logits(hidden)
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=2e-4)


def test_a_preempted_request_that_streamed_is_not_ended_by_the_queue_time(model_dirs):
    """The maximum queue time is for requests that never started: one preempted (back in the
    queue, its KV freed) after its first tokens runs to the end."""
    llm = LLM(model=str(model_dirs("llama")), max_num_seqs=8, num_kv_blocks=12, block_size=16)
    engine = llm.engine
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"q{i}", list(range(10 + i, 50 + i)), params)
    finished: dict[str, object] = {}
    while engine.has_unfinished():
        if engine.stats()["num_preemptions"]:
            # The queue time of every request that has streamed is up from here on.
            streamed = [
                rid
                for rid, state in engine.requests.items()
                if any(s.num_output_tokens for s in state.seqs)
            ]
            engine.deadlines.queue_deadlines.update(dict.fromkeys(streamed, 0.0))
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert engine.stats()["num_preemptions"] > 0, "the setup should have forced preemption"
    assert len(finished) == 6
    assert all(out.error is None for out in finished.values()), [
        (rid, out.error) for rid, out in finished.items() if out.error
    ]
    assert llm.stats()["kv_blocks_used"] == 0
