"""Prometheus metrics through Ray's metrics API, created lazily in the process that uses them."""

from __future__ import annotations

from typing import Any

_METRICS: dict[str, Any] = {}

_SECONDS_BUCKETS = [0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0]


def _get(cls_name: str, name: str, description: str, **kwargs: Any) -> Any:
    metric = _METRICS.get(name)
    if metric is None:
        from ray.util import metrics

        metric = getattr(metrics, cls_name)(name, description=description, **kwargs)
        _METRICS[name] = metric
    return metric


def record_grammar_compile(kind: str, seconds: float, hit: bool, outcome: str) -> None:
    """GrammarService's `on_compile` hook: time and outcome of every compile request."""
    tags = {"kind": kind, "cache": "hit" if hit else "miss", "outcome": outcome}
    _get(
        "Histogram",
        "serve_app_grammar_compile_seconds",
        "Time a request waited for its compiled grammar.",
        boundaries=_SECONDS_BUCKETS,
        tag_keys=("kind", "cache", "outcome"),
    ).observe(seconds, tags=tags)
    _get(
        "Counter",
        "serve_app_grammar_compiles_total",
        "Grammar compile requests by kind, cache hit or miss, and outcome.",
        tag_keys=("kind", "cache", "outcome"),
    ).inc(tags=tags)
