"""What a JSON schema costs the decode step: the same batch in steady decode with and without
a production-shaped schema (nested objects, enums, arrays; long enough that no row ends
early, so both sides decode the same number of tokens), the grammar masks' fill time per step
(one batched xgrammar call on its own thread, while the forward runs) and the part of it the
forward did not hide.

    python benchmarks/grammar_masks.py --model bench --batches 16,64
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
import xgrammar as xgr

sys.path.insert(0, os.path.dirname(__file__))
from common import DECODE_SCHEMA, resolve_model, run_header, write_json  # noqa: E402

from actors import LLM, SamplingParams  # noqa: E402
from actors.grammar_cache import load_tokenizer_info  # noqa: E402
from actors.grammar_state import GrammarConstraint, MaskFiller  # noqa: E402

RATIO_TARGET = 0.95  # constrained / unconstrained decode speed


class Spans:
    """Per step: when the forward ended and when that step's masks were ready."""

    def __init__(self, llm: LLM) -> None:
        self.forward_end: list[float] = []
        self.fill: list[tuple[float, float]] = []
        worker = llm.engine.executor.worker
        real_forward, real_fill = worker.forward, MaskFiller._fill
        spans = self

        def forward(step):
            real_forward(step)
            spans.forward_end.append(time.perf_counter())

        def fill(filler, *args):
            start = time.perf_counter()
            masks = real_fill(filler, *args)
            spans.fill.append((start, time.perf_counter()))
            return masks

        worker.forward = forward
        llm.engine.masks._fill = fill.__get__(llm.engine.masks)

    def clear(self) -> None:
        self.forward_end.clear()
        self.fill.clear()


def start_batch(llm: LLM, batch: int, grammar, prompt_len: int, tokens: int, tag: str) -> None:
    """`batch` rows (each with its own matcher when `grammar` is set), run to their first
    token, so every step from here on is steady decode."""
    engine = llm.engine
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(5, engine.model_config.vocab_size) for _ in range(prompt_len)]
        constraints = [GrammarConstraint(grammar)] if grammar is not None else None
        engine.add_request(f"{tag}-{i}", prompt, params, constraints=constraints)
    while any(s.num_output_tokens == 0 for r in engine.requests.values() for s in r.seqs):
        engine.step()


def timed_step(llm: LLM) -> float:
    start = time.perf_counter()
    llm.engine.step()
    return time.perf_counter() - start


def level(path: str, grammar, batch: int, repeats: int, tokens: int) -> dict:
    """Two engines with the same weights, one batch each (the same prompts, one of them
    constrained), stepped in turn: this machine's speed drifts, so each constrained step is
    set against the unconstrained step just before it."""
    ratios, plain, constrained, fills, exposed = [], [], [], [], []
    kwargs = {"model": path, "max_num_seqs": batch, "max_model_len": 1024}
    with LLM(**kwargs) as free, LLM(**kwargs) as bound:
        spans = Spans(bound)
        for r in range(repeats):
            start_batch(free, batch, None, 128, tokens, f"p{r}")
            start_batch(bound, batch, grammar, 128, tokens, f"c{r}")
            spans.clear()
            # The last step ends the rows (frees, detokenizes) on both sides alike: not timed.
            for _ in range(tokens - 2):
                p, c = timed_step(free), timed_step(bound)
                plain.append(p)
                constrained.append(c)
                ratios.append(p / c)
            while free.engine.has_unfinished() or bound.engine.has_unfinished():
                free.engine.step()
                bound.engine.step()
            pairs = zip(spans.fill, spans.forward_end[-len(spans.fill) :], strict=True)
            for (start, end), forward_end in pairs:
                fills.append(end - start)
                exposed.append(max(0.0, end - forward_end))
    return {
        "batch": batch,
        "unconstrained_step_ms": statistics.median(plain) * 1e3,
        "json_schema_step_ms": statistics.median(constrained) * 1e3,
        # The median over step pairs of unconstrained / constrained step time.
        "ratio": statistics.median(ratios),
        "mask_fill_ms_per_step": statistics.mean(fills) * 1e3,
        "mask_fill_ms_p90": sorted(fills)[int(0.9 * len(fills))] * 1e3,
        "mask_fill_exposed_ms_per_step": statistics.mean(exposed) * 1e3,
        "step_pairs": len(ratios),
    }


def run(path: str, batches: list[int], repeats: int, tokens: int) -> dict:
    info = load_tokenizer_info(path)
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(DECODE_SCHEMA))
    levels = [level(path, grammar, batch, repeats, tokens) for batch in batches]
    return {
        "schema": "items[200+] of {id, kind enum, tags enum[], where {city, zip}, note}",
        "decode_tokens": tokens,
        "prompt_tokens": 128,
        "levels": levels,
        "target": f"ratio >= {RATIO_TARGET}",
        "met": all(lv["ratio"] >= RATIO_TARGET for lv in levels),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    result = {
        **run_header(model),
        **run(model.path, [int(b) for b in args.batches.split(",")], args.repeats, args.tokens),
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
