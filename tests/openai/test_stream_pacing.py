"""Stream events are not batched on their way out: with the engine slowed to ~50 ms per step
(`engine.step_delay_s`), every streamed chunk carries one token and reaches the client about
one step after the previous one, through the real Serve proxy."""

from __future__ import annotations

import json
import statistics
import time

import httpx
import pytest

from tests.support.side_apps import side_app, side_config

pytestmark = [pytest.mark.serve, pytest.mark.ray]

STEP_DELAY_S = 0.05
TOKENS = 40


@pytest.fixture(scope="module")
def paced_url(serve_url, ray_session, model_dirs, tmp_path_factory):
    config = side_config(
        model_dirs("llama"),
        "paced-tiny",
        tmp_path_factory.mktemp("paced-data"),
        engine={"step_delay_s": STEP_DELAY_S},
    )
    with side_app(config, "serve-app-paced", "/paced", serve_url, ray_session) as (url, _):
        yield url


def timed_chunks(url: str, body: dict) -> list[tuple[float, dict]]:
    """Each streamed chunk that carries tokens, with its arrival time."""
    out = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk["choices"] and chunk["choices"][0].get("token_ids"):
                out.append((time.monotonic(), chunk))
    return out


def test_each_token_leaves_in_its_own_chunk_about_one_step_apart(paced_url):
    body = {
        "model": "paced-tiny",
        "prompt": "Tell me about the weather",
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    chunks = timed_chunks(paced_url, body)
    per_chunk = [len(c["choices"][0]["token_ids"]) for _, c in chunks]
    assert sum(per_chunk) == TOKENS
    # No hidden batching: one token per chunk (a UTF-8 or stop-string hold-back may merge a
    # few, the model's random text gives a handful at most).
    assert len(chunks) >= TOKENS - 3, per_chunk
    gaps = [b[0] - a[0] for a, b in zip(chunks, chunks[1:], strict=False)]
    # Deltas arrive one step apart: at least the injected delay, and a batching proxy would
    # show near-zero gaps followed by long ones.
    assert statistics.median(gaps) >= 0.8 * STEP_DELAY_S, gaps
    assert statistics.median(gaps) <= 0.1, gaps
    assert sum(g < 0.5 * STEP_DELAY_S for g in gaps) <= 3, gaps
