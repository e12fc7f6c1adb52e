"""Shared benchmark helpers: checkpoints, request sets, JSON output."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

CACHE = Path.home() / ".cache" / "serve-app" / "models"


def checkpoint(arch: str = "llama", preset: str = "bench", seed: int = 0) -> str:
    from serve_app.model_factory import make_model

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


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


def write_json(result: dict, out: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
