"""Shared benchmark helpers: checkpoints, request sets, JSON output."""

from __future__ import annotations

import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

CACHE = Path.home() / ".cache" / "serve-app" / "models"
# What every benchmark runs on unless told otherwise: the trained demo model.
DEFAULT_MODEL = "smollm2-135m-instruct"
SEEDED_PRESETS = ("tiny", "bench")


class Model(NamedTuple):
    path: str  # a Hugging Face folder
    label: str  # what the JSON calls it


def resolve_model(name: str) -> Model:
    """`--model`: a trained preset (`smollm2-135m-instruct`, the folder `make demo-model`
    writes), a seeded random preset (`bench`, `tiny`: llama shape), or a checkpoint folder
    or GGUF file."""
    from serve_app.checkpoints.trained import TRAINED_PRESETS, make_trained_model

    if name in TRAINED_PRESETS:
        path = CACHE / name
        if not (path / "config.json").is_file():
            make_trained_model(path, name)
        return Model(str(path), name)
    if name in SEEDED_PRESETS:
        return Model(checkpoint("llama", name), f"llama-{name}")
    from actors.models.gguf import resolve_checkpoint

    return Model(resolve_checkpoint(name), Path(name).name)


def checkpoint(arch: str = "llama", preset: str = "bench", seed: int = 0) -> str:
    from serve_app.checkpoints.factory import make_model

    path = CACHE / f"{preset}-{arch}-{seed}"
    if not (path / "config.json").is_file():
        make_model(path, arch=arch, preset=preset, seed=seed, force=True)
    return str(path)


def mixed_requests(
    n: int, vocab: int, prompt_range=(16, 512), output_range=(16, 256), seed: int = 0
) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) pairs with lengths drawn uniformly from the ranges."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        out.append(([rng.randrange(5, vocab) for _ in range(plen)], rng.randint(*output_range)))
    return out


def exact_params(requests: list[tuple[list[int], int]]) -> list:
    """Greedy parameters under which each (prompt, max_tokens) request makes exactly its
    max_tokens tokens (our engine's `SamplingParams`)."""
    from actors import SamplingParams

    return [
        SamplingParams(max_tokens=m, min_tokens=m, temperature=0, ignore_eos=True)
        for _, m in requests
    ]


def step_loop(
    add: Callable[[str, list[int], int], None],
    step: Callable[[], int],
    requests: list[tuple[list[int], int]],
    concurrency: int,
) -> float:
    """Seconds to run `requests` through an engine in-process, in order, with at most
    `concurrency` in flight (the next added as soon as one finishes), as a server at that
    concurrency sees them: `add(request_id, prompt_ids, max_tokens)` queues one, `step()`
    runs one engine step and says how many requests it finished. Plain Python on purpose:
    vLLM's side runs it in its own venv (vllm_peer.py)."""
    queue = list(reversed(requests))
    in_flight = 0
    started = time.perf_counter()
    while queue or in_flight:
        while queue and in_flight < concurrency:
            ids, max_tokens = queue.pop()
            add(f"loop-{len(queue)}", ids, max_tokens)
            in_flight += 1
        in_flight -= step()
    return time.perf_counter() - started


def ours_step_loop(engine, requests: list[tuple[list[int], int]], concurrency: int):
    """Our `EngineCore` through `step_loop`, greedy, every request exactly its max_tokens:
    the seconds and the output tokens."""
    from actors import SamplingParams

    tokens = 0

    def add(request_id: str, ids: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        engine.add_request(request_id, ids, params)

    def step() -> int:
        nonlocal tokens
        finished = 0
        for out in engine.step():
            tokens += sum(len(d.token_ids) for d in out.deltas)
            finished += out.finished
        return finished

    return step_loop(add, step, requests, concurrency), tokens


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


def best_of(fn: Callable[[], object], reps: int) -> float:
    """The fastest of `reps` timed calls of `fn`, in seconds, after one untimed call."""
    fn()
    seconds = []
    for _ in range(reps):
        with Timer() as t:
            fn()
        seconds.append(t.seconds)
    return min(seconds)


def ab_generate(
    llm,
    phases: dict[str, list[tuple[list[int], int]]],
    rounds: int,
    sides: tuple[str, str],
    switch: Callable[[str], None],
    counted: Callable[[list[tuple[list[int], int]]], int],
    unit: str = "tok_s",
) -> tuple[dict, bool]:
    """Each phase's requests through our `LLM.generate` under two settings in turn
    (`switch(side)` before each run; AB, BA, ... by round, so drift weighs on both): per
    phase each side's median of `counted(requests)` per second, the first side's over the
    second's, each round's ratio and every run. Also whether both sides made the same tokens
    in every run. The caller puts its setting back afterwards."""
    first, second = sides
    runs: dict[str, dict[str, list[float]]] = {name: {first: [], second: []} for name in phases}
    same_tokens = True
    for r in range(rounds):
        for name, reqs in phases.items():
            tokens = {}
            for side in sides if r % 2 == 0 else sides[::-1]:
                switch(side)
                with Timer() as t:
                    results = llm.generate([p for p, _ in reqs], exact_params(reqs))
                tokens[side] = [x.outputs[0].token_ids for x in results]
                runs[name][side].append(counted(reqs) / t.seconds)
            same_tokens &= tokens[first] == tokens[second]
    out = {}
    for name, by_side in runs.items():
        a, b = statistics.median(by_side[first]), statistics.median(by_side[second])
        out[name] = {
            f"{first}_{unit}": round(a, 1),
            f"{second}_{unit}": round(b, 1),
            "ratio": round(a / b, 3),
            "pairs": [
                round(x / y, 3) for x, y in zip(by_side[first], by_side[second], strict=True)
            ],
            "runs": {k: [round(v, 1) for v in vs] for k, vs in by_side.items()},
        }
    return out, same_tokens


def kernel_bench_model(name: str, threads: int):
    """The start of a CPU-kernel benchmark: the engine's kernels built (or exit saying so),
    torch on `threads`, the checkpoint resolved. Its `Model` and fp32 `ModelConfig`."""
    import torch

    from actors.config import ModelConfig
    from actors.layers import kernels

    if not kernels.available():
        raise SystemExit("the engine's CPU kernels are not built here (make kernels)")
    torch.set_num_threads(threads)
    model = resolve_model(name)
    return model, ModelConfig.from_pretrained(model.path, dtype=torch.float32)


def run_header(model: Model, dtype: str = "float32") -> dict:
    """What every in-process benchmark's JSON starts with: the checkpoint, dtype and threads."""
    import torch

    return {"checkpoint": model.label, "dtype": dtype, "threads": torch.get_num_threads()}


def cpu_model() -> str:
    """The host's CPU as /proc/cpuinfo names it (for the JSON: figures differ by host)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def write_json(result: dict, out: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")


def median_level(rounds: tuple[dict, ...]) -> dict:
    """One level's figures over rounds: the median of every number (nested alike)."""
    first = rounds[0]
    out: dict = {}
    for key, value in first.items():
        if isinstance(value, dict):
            out[key] = median_level(tuple(r[key] for r in rounds))
        elif isinstance(value, int) and not isinstance(value, bool):  # counts stay whole
            out[key] = statistics.median_low(r[key] for r in rounds)
        elif isinstance(value, float):
            out[key] = statistics.median(r[key] for r in rounds)
        else:
            out[key] = value
    return out


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def venv_tool(name: str) -> str:
    """A console script installed next to this interpreter (serve-app, transformers)."""
    import shutil
    import sys

    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.is_file() else (shutil.which(name) or name)


def text_prompts(
    model: str, n: int, prompt_range: tuple[int, int] = (64, 256), seed: int = 0
) -> list[tuple[str, int]]:
    """`n` text prompts cut from the packaged corpus, with their length in the model's tokens.

    Text (not token ids) so that any OpenAI-compatible server takes the same request set.
    """
    from transformers import AutoTokenizer

    from serve_app.checkpoints.factory import corpus_texts

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.model_max_length = 1 << 30  # the corpus is longer than a context; we cut it
    ids = tokenizer.encode("\n".join(corpus_texts()), add_special_tokens=False)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(*prompt_range)
        start = rng.randrange(0, len(ids) - length)
        text = tokenizer.decode(ids[start : start + length])
        out.append((text, len(tokenizer.encode(text, add_special_tokens=False))))
    return out


_ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "kind": {"enum": ["person", "place", "thing", "event"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "where": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "integer"}},
            "required": ["city", "zip"],
        },
        "note": {"type": "string", "maxLength": 12},
    },
    "required": ["id", "kind", "tags", "where", "note"],
}
DECODE_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": _ITEM, "minItems": 200}},
    "required": ["items"],
}
