"""A step's grammar masks fill on their own thread while its forward runs, batched, and the
sampler applies them: constrained rows follow their grammar, unconstrained batch mates are
untouched, and no matcher is read while it advances."""

from __future__ import annotations

import re
import threading
import time

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from actors import LLM, SamplingParams
from actors.grammar_state import GrammarConstraint, MaskFiller

PATTERN = r"(cat|dog)-[0-9]{2,4}"
PROMPTS = ["pet:", "The quick brown fox", "x = [1, 2, 3]", "another pet:"]


@pytest.fixture(scope="module")
def tiny(model_dirs) -> str:
    return str(model_dirs("llama"))


@pytest.fixture(scope="module")
def compiled(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=tokenizer.vocab_size)
    return tokenizer, xgr.GrammarCompiler(info).compile_regex(PATTERN)


def run(llm: LLM, tokenizer, constrained: list[GrammarConstraint | None]) -> list[str]:
    """Every prompt in one batch; row i under constrained[i] (None: free)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
    texts = {f"r{i}": "" for i in range(len(PROMPTS))}
    for i, (prompt, c) in enumerate(zip(PROMPTS, constrained, strict=True)):
        ids = tokenizer.encode(prompt)
        engine.add_request(f"r{i}", ids, params, constraints=[c] if c else None)
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] += "".join(d.text for d in out.deltas)
    return [texts[f"r{i}"] for i in range(len(PROMPTS))]


def test_constrained_rows_follow_their_grammar_and_batch_mates_are_untouched(tiny, compiled):
    tokenizer, grammar = compiled
    llm = LLM(model=tiny)
    try:
        free = run(llm, tokenizer, [None] * len(PROMPTS))
        constraints = [GrammarConstraint(grammar), None, None, GrammarConstraint(grammar)]
        before = llm.engine.masks.stats()
        mixed = run(llm, tokenizer, constraints)
        after = llm.engine.masks.stats()
    finally:
        llm.close()
    for text in (mixed[0], mixed[3]):
        assert re.fullmatch(PATTERN, text), text
    assert all(c.num_rejected == 0 for c in constraints if c)
    # Seeded rows draw from their own generators: a free row's text does not depend on
    # whether its batch mates were constrained.
    assert (mixed[1], mixed[2]) == (free[1], free[2])
    steps = after["mask_fill_steps"] - before["mask_fill_steps"]
    rows = after["mask_fill_rows"] - before["mask_fill_rows"]
    # Both constrained rows sampled together, one batched fill per step for the pair.
    assert steps >= 3 and rows >= 2 * steps - 2, (steps, rows)


def test_masks_fill_on_their_own_thread_while_the_forward_runs(tiny, compiled, monkeypatch):
    tokenizer, grammar = compiled
    llm = LLM(model=tiny)
    spans: dict[str, list[tuple[float, float, int]]] = {"forward": [], "fill": []}
    fill_started = threading.Event()
    worker = llm.engine.executor.worker
    real_forward, real_fill = worker.forward, MaskFiller._fill

    def forward(step):
        start = time.perf_counter()
        real_forward(step)
        # When row 0 (constrained) samples: long enough for a fill that runs meanwhile to
        # begin; a fill that ran before the forward, or on this thread, shows in the spans.
        if any(item.sample and item.seq_id.startswith("r0") for item in step.items):
            fill_started.wait(timeout=5)
            fill_started.clear()
        spans["forward"].append((start, time.perf_counter(), threading.get_ident()))

    def fill(self, *args):
        start = time.perf_counter()
        fill_started.set()
        masks = real_fill(self, *args)
        spans["fill"].append((start, time.perf_counter(), threading.get_ident()))
        return masks

    monkeypatch.setattr(worker, "forward", forward)
    monkeypatch.setattr(MaskFiller, "_fill", fill)
    try:
        constraints = [GrammarConstraint(grammar)] + [None] * (len(PROMPTS) - 1)
        text = run(llm, tokenizer, constraints)[0]
    finally:
        llm.close()
    assert re.fullmatch(PATTERN, text), text
    assert spans["fill"]
    forwards = {round(f[0], 9): f for f in spans["forward"]}
    for fill_start, fill_end, fill_thread in spans["fill"]:
        # The forward whose run this fill overlapped: started before the fill ended, ended
        # after it started.
        overlapping = [f for f in forwards.values() if f[0] < fill_end and fill_start < f[1]]
        assert overlapping, (fill_start, fill_end)
        assert all(thread != fill_thread for _, _, thread in overlapping)


def test_closing_the_engine_ends_the_fill_thread(tiny, compiled):
    tokenizer, grammar = compiled
    llm = LLM(model=tiny)
    before = set(threading.enumerate())
    run(llm, tokenizer, [GrammarConstraint(grammar)] + [None] * (len(PROMPTS) - 1))
    started = [t for t in set(threading.enumerate()) - before if t.name.startswith("grammar-masks")]
    assert len(started) == 1
    llm.close()
    assert not started[0].is_alive()
