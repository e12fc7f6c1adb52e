"""Kept decode gathers: a decode step copies only each sequence's newest block into the K/V
it gathered last step, and generates exactly what a fresh gather of every block does."""

from __future__ import annotations

import pytest

from actors import LLM, SamplingParams
from actors.model_runner import _only_fresh_changed

REUSE_ENV = "SERVE_APP_DECODE_GATHER_REUSE"
ATTENTION_ENV = "SERVE_APP_DECODE_ATTENTION"


def _run(
    path: str, monkeypatch, reuse: bool, attention: str = "gather", **llm_options
) -> tuple[dict, dict]:
    """Staggered arrivals (buckets change members), 4-token blocks (sequences cross block
    boundaries every few steps), prompts that share a prefix, n=2 and seeded sampling."""
    monkeypatch.setenv(REUSE_ENV, "1" if reuse else "0")
    monkeypatch.setenv(ATTENTION_ENV, attention)
    llm = LLM(model=path, block_size=4, **llm_options)
    runner = llm.engine.executor.worker.runner
    shared = list(range(300, 340))
    prompts = [shared + [5, 6, 7], list(range(50, 58)), shared + [9], list(range(400, 470))]
    prompts += [list(range(20 + i, 33 + 3 * i)) for i in range(6)]
    engine = llm.engine
    seen: dict[str, list] = {}
    step = 0
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:
            i, prompt = pending.pop(0)
            params = SamplingParams(
                max_tokens=12 + 5 * i,
                temperature=0.8 if i % 3 == 1 else 0.0,
                seed=i,
                n=2 if i == 2 else 1,
                logprobs=2,
                ignore_eos=True,
            )
            engine.add_request(f"r{i}", prompt, params)
        for out in engine.step():
            for delta in out.deltas:
                got = seen.setdefault(f"{out.request_id}/{delta.index}", [])
                pairs = zip(delta.token_ids, delta.logprobs, strict=True)
                got += [(t, lp.logprob, lp.top) for t, lp in pairs]
        step += 1
    return seen, runner.gather_counts


@pytest.mark.parametrize(
    ("options", "min_reused"),
    # 48 blocks hold less than the prompts: requests wait and are preempted.
    [({}, 0.5), ({"num_kv_blocks": 48}, 0.0)],
    ids=["roomy", "preempting"],
)
def test_kept_gathers_generate_what_fresh_gathers_do(model_dirs, monkeypatch, options, min_reused):
    path = str(model_dirs("llama"))
    fresh, fresh_counts = _run(path, monkeypatch, False, **options)
    kept, kept_counts = _run(path, monkeypatch, True, **options)
    assert fresh_counts["kept"] == 0
    assert kept_counts["kept"] >= min_reused * kept_counts["buckets"]
    assert len(kept) == 11  # ten requests, one with two samples
    assert kept == fresh  # same tokens, same logprobs, bit for bit


@pytest.mark.parametrize("options", [{}, {"num_kv_blocks": 48}], ids=["roomy", "preempting"])
def test_in_place_decode_attention_generates_what_the_gathers_do(model_dirs, monkeypatch, options):
    """The CPU kernel that reads the paged cache in place: the same tokens as the gathering
    path, logprobs within fp32 rounding (it sums in another order)."""
    path = str(model_dirs("llama"))
    gathered, _ = _run(path, monkeypatch, False, **options)
    in_place, counts = _run(path, monkeypatch, True, attention="in_place", **options)
    assert counts["buckets"] == 0  # no gathers at all
    assert in_place.keys() == gathered.keys()
    for key, want in gathered.items():
        got = in_place[key]
        assert [t for t, _, _ in got] == [t for t, _, _ in want], key
        for (_, lp, top), (_, lp_want, top_want) in zip(got, want, strict=True):
            assert lp == pytest.approx(lp_want, abs=1e-4)
            assert [t for t, _ in top] == [t for t, _ in top_want]


def test_a_gather_is_reused_only_when_just_the_newest_blocks_moved():
    before = (("a", "b"), 3, [7, 8, 0, 4, 0, 0])
    # a's token lands in block 8 (position 1), b's crosses into a new block (position 4).
    assert _only_fresh_changed(before, (("a", "b"), 3, [7, 8, 0, 4, 5, 0]), [1, 4])
    # A block id changed outside the fresh positions (a table rewritten): gather again.
    assert not _only_fresh_changed(before, (("a", "b"), 3, [9, 8, 0, 4, 5, 0]), [1, 4])
    # Other members, another order, another width: gather again.
    assert not _only_fresh_changed(before, (("b", "a"), 3, [7, 8, 0, 4, 5, 0]), [1, 4])
    assert not _only_fresh_changed(before, (("a", "b"), 4, [7, 8, 0, 0, 4, 5, 0, 0]), [1, 5])
