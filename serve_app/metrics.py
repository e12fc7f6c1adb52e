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


_LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


def record_latency(name: str, seconds: float, endpoint: str) -> None:
    """`name`: ttft, itl (a stream's mean gap between chunks), e2e (ingress) or queue
    (engine); one histogram each, one observation per request."""
    _get(
        "Histogram",
        f"serve_app_{name}_seconds",
        f"Request {name} in seconds.",
        boundaries=_LATENCY_BUCKETS,
        tag_keys=("endpoint",),
    ).observe(seconds, tags={"endpoint": endpoint})


_TOKENS_PER_CHUNK_BUCKETS = [1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0]


def record_tokens_per_chunk(endpoint: str, tokens_per_chunk: float) -> None:
    """One observation per stream: its output tokens per token-carrying SSE event (1 while
    the writer keeps up; more where it fell behind and coalesced pending tokens)."""
    _get(
        "Histogram",
        "serve_app_stream_tokens_per_chunk",
        "A stream's output tokens per token-carrying SSE event.",
        boundaries=_TOKENS_PER_CHUNK_BUCKETS,
        tag_keys=("endpoint",),
    ).observe(tokens_per_chunk, tags={"endpoint": endpoint})


def record_outcome(endpoint: str, outcome: str, code: str = "") -> None:
    """Finished requests by outcome (a finish reason, or `error`) and error code, so client
    cancels, overload and internal timeouts are told apart."""
    _get(
        "Counter",
        "serve_app_requests_total",
        "Finished requests by endpoint, outcome and error code.",
        tag_keys=("endpoint", "outcome", "code"),
    ).inc(tags={"endpoint": endpoint, "outcome": outcome, "code": code})


def record_tokens(endpoint: str, prompt: int, output: int, cached: int) -> None:
    for kind, value in (("prompt", prompt), ("output", output), ("cached", cached)):
        if value:
            _get(
                "Counter",
                "serve_app_tokens_total",
                "Tokens by kind: prompt, output, cached (cached are part of prompt).",
                tag_keys=("endpoint", "kind"),
            ).inc(value, tags={"endpoint": endpoint, "kind": kind})


def record_engine_gauges(replica: str, stats: dict) -> None:
    for key in ("running", "waiting", "held", "kv_blocks_used", "kv_blocks_total"):
        _get(
            "Gauge",
            f"serve_app_engine_{key}",
            f"Engine replica {key}.",
            tag_keys=("replica",),
        ).set(float(stats.get(key, 0)), tags={"replica": replica})


# Ray wants positive boundaries: the half-way points bucket exact counts (0 in the first).
_ACCEPTED_LENGTH_BUCKETS = [0.5, 1.5, 2.5, 3.5, 4.5, 6.5, 8.5, 12.5, 16.5]


def record_speculation(proposer: str, proposed: int, accepted: int) -> None:
    """One verified draft: its proposed and accepted tokens, and the accepted run's length."""
    tags = {"proposer": proposer}
    for kind, value in (("proposed", proposed), ("accepted", accepted)):
        if value:
            _get(
                "Counter",
                f"serve_app_spec_{kind}_tokens_total",
                f"Speculative decoding: draft tokens {kind}, per proposer.",
                tag_keys=("proposer",),
            ).inc(value, tags=tags)
    _get(
        "Histogram",
        "serve_app_spec_acceptance_length",
        "Speculative decoding: accepted draft tokens per verified draft, per proposer.",
        boundaries=_ACCEPTED_LENGTH_BUCKETS,
        tag_keys=("proposer",),
    ).observe(accepted, tags=tags)
