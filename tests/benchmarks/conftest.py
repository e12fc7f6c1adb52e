"""`benchmarks/` is a folder of scripts, not a package: a test imports them through this."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def benchmark_modules(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`benchmarks/` importable for one test; its modules forgotten after it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if (getattr(sys.modules[name], "__file__", None) or "").startswith(str(BENCHMARKS)):
            del sys.modules[name]
