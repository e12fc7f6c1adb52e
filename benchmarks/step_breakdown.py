"""Where a decode step's time goes: linear layers, attention, LM head, sampling, host.

Runs `batch` sequences in steady decode on one engine (single process, no Ray) and times
each part of a step by wrapping the instances that do it:

- linear: every QKV / O / gate-up / down projection (the layers' own forward);
- attention: the paged-attention backend (KV write, gather, softmax(QK^T)V);
- other_model_ops: the rest of the model's forward (embedding, RMSNorm, rotary, SiLU);
- lm_head: `compute_logits` over the sampled rows;
- sampling: the sampler (penalties, masks, draw);
- host: the engine step minus all of the above (scheduling, step input, tensors, outputs).

CPU ops are synchronous, so wall-clock wrappers measure the op. The wrappers cost about a
microsecond each; `unprobed_step_ms` is the same step timed without them.

    python benchmarks/step_breakdown.py --model smollm2-135m-instruct --batches 1,16,64
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

sys.path.insert(0, os.path.dirname(__file__))
from common import resolve_model, run_header, write_json  # noqa: E402

from actors import LLM, SamplingParams  # noqa: E402

PARTS = ("linear", "attention", "other_model_ops", "lm_head", "sampling", "host")


class _Clock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return timed


@contextmanager
def probes(runner):
    """Times the runner's parts while inside; puts every original back on exit."""
    from actors.layers.linear import ColumnParallelLinear, RowParallelLinear

    clock = _Clock()
    model = runner.model
    patched: list[tuple[object, str, object, bool]] = []

    def patch(obj, attr: str, name: str) -> None:
        had = attr in vars(obj)
        original = getattr(obj, attr)
        patched.append((obj, attr, vars(obj).get(attr), had))
        setattr(obj, attr, clock.wrap(name, original))

    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            patch(module, "forward", "linear")
    patch(runner.backend, "forward", "attention")
    patch(model, "forward", "model_forward")
    patch(model, "compute_logits", "lm_head")
    sampler = runner.sampler
    runner.sampler = clock.wrap("sampling", sampler)
    try:
        yield clock
    finally:
        runner.sampler = sampler
        for obj, attr, original, had in reversed(patched):
            if had:
                setattr(obj, attr, original)
            else:
                delattr(obj, attr)


def fill_decoding(engine, batch: int, prompt_len: int, vocab: int, tag: str) -> None:
    """`batch` sequences, all past prefill, each with room for many more tokens."""
    import random

    rng = random.Random(batch)
    params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(5, vocab) for _ in range(prompt_len)]
        engine.add_request(f"{tag}-{i}", prompt, params)
    # Until every sequence has its first token (prefill done, decode from here on).
    while any(s.num_output_tokens == 0 for r in engine.requests.values() for s in r.seqs):
        engine.step()


def breakdown(llm: LLM, batch: int, steps: int, prompt_len: int) -> dict:
    engine = llm.engine
    runner = engine.executor.worker.runner
    vocab = llm.engine.model_config.vocab_size
    tag = f"b{batch}"
    fill_decoding(engine, batch, prompt_len, vocab, tag)
    for _ in range(3):  # warm-up decode steps
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    unprobed = (time.perf_counter() - start) / steps
    with probes(runner) as clock:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - start
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.step()
    s = {k: v / steps for k, v in clock.seconds.items()}
    step = total / steps
    parts = {
        "linear": s["linear"],
        "attention": s["attention"],
        "other_model_ops": s["model_forward"] - s["linear"] - s["attention"],
        "lm_head": s["lm_head"],
        "sampling": s["sampling"],
    }
    parts["host"] = step - sum(parts.values())
    return {
        "batch": batch,
        "context_tokens": prompt_len,
        "step_ms": step * 1e3,
        "unprobed_step_ms": unprobed * 1e3,
        "decode_tok_s": batch / unprobed,
        "ms": {k: parts[k] * 1e3 for k in PARTS},
        "share": {k: parts[k] / step for k in PARTS},
    }


def run(path: str, batches: list[int], steps: int, prompt_len: int) -> list[dict]:
    llm = LLM(model=path, max_model_len=max(1024, prompt_len + 8 * steps + 64))
    try:
        return [breakdown(llm, b, steps, prompt_len) for b in batches]
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = resolve_model(args.model)
    result = {
        **run_header(model),
        "device": "cpu",
        "steps": run(
            model.path, [int(b) for b in args.batches.split(",")], args.steps, args.context
        ),
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
