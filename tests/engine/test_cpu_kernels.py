"""The engine's CPU kernels (actors/csrc/).

Decode attention reads each sequence's blocks where they lie in the paged cache, and must give
what attention over the same keys and values laid out contiguously gives: for every head
layout, head dim, window and dtype the engine serves, with several query rows per sequence
(the verification shape of speculative decoding), and independent of the other rows in the
call. Prefill attention must give what torch's causal SDPA gives over the same chunk and cached
prefix, on the engine's own strided views. The fused small ops (RMSNorm with its residual add,
rotary, SiLU-and-mul) must give what the torch modules they replace give. A grammar row's
masked argmax must be torch.argmax of the row masked first (-1 where nothing allowed scores
above -inf), and the grammar mask must write -inf over exactly the forbidden tokens of the
rows it is given, and nowhere else. The panel linear kernel must give what F.linear gives, and
a row's result must not depend on the rows beside it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from actors import LLM, SamplingParams, platform
from actors.layers import kernels
from actors.layers.norm import RMSNorm
from actors.layers.rotary import RotaryEmbedding
from actors.models.llama import LlamaMLP
from tests.support.grammar import masked_by_bits


def test_the_project_builds_its_kernels_on_this_machine():
    # The install builds them (make venv); a machine with a compiler must have them, or the
    # engine silently runs the slower gathering path.
    assert kernels.available()
    assert platform.inplace_decode_attention(torch.device("cpu"))
    assert platform.cpu_prefill_attention(torch.device("cpu"))
    assert platform.fused_cpu_ops(torch.device("cpu"))
    assert platform.cpu_sampler_kernels()
    assert platform.use_panel_linear(torch.device("cpu"), torch.float32)


def _cache(heads_kv, num_blocks, block_size, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (heads_kv, num_blocks, block_size, d)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _reference(q, k_cache, v_cache, table, ctx, window):
    """Attention of one query row (heads, d) over the sequence's first `ctx` positions."""
    h_kv, _, bs, d = k_cache.shape
    keys = k_cache[:, table].reshape(h_kv, -1, d)[:, :ctx].float()
    values = v_cache[:, table].reshape(h_kv, -1, d)[:, :ctx].float()
    first = max(0, ctx - window) if window else 0
    keys, values = keys[:, first:], values[:, first:]
    group = q.shape[0] // h_kv
    keys = keys.repeat_interleave(group, 0)
    values = values.repeat_interleave(group, 0)
    scores = (q.float().unsqueeze(1) @ keys.transpose(1, 2)).squeeze(1) / math.sqrt(d)
    return (scores.softmax(-1).unsqueeze(1) @ values).squeeze(1).reshape(-1)


def _call(q, k_cache, v_cache, tables, row_seq, row_ctx, window=0):
    d = q.shape[-1]
    return torch.ops.serve_app.paged_decode_attention(
        q,
        k_cache,
        v_cache,
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(row_seq, dtype=torch.int32),
        torch.tensor(row_ctx, dtype=torch.int32),
        window,
        1.0 / math.sqrt(d),
    )


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "window"),
    [(9, 3, 64, 0), (8, 4, 64, 0), (4, 4, 128, 0), (8, 2, 16, 0), (8, 4, 64, 5), (6, 2, 48, 0)],
    ids=["smollm2", "bench", "mha-128", "tiny-16", "window", "odd-dim"],
)
def test_decode_rows_match_attention_over_contiguous_kv(heads, kv_heads, d, window):
    block_size, num_blocks = 4, 40
    k_cache, v_cache = _cache(kv_heads, num_blocks, block_size, d, torch.float32)
    # Scattered, non-monotonic block ids; contexts ending mid-block and on a block's edge.
    tables = [[7, 2, 30, 11, 5], [1, 39, 0, 0, 0], [25, 3, 17, 9, 0]]
    contexts = [19, 8, 13]
    q = torch.randn(3, heads, d, generator=torch.Generator().manual_seed(1))
    out = _call(q, k_cache, v_cache, tables, [0, 1, 2], contexts, window)
    assert out.shape == (3, heads * d)
    for r in range(3):
        want = _reference(q[r], k_cache, v_cache, tables[r], contexts[r], window)
        torch.testing.assert_close(out[r], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "window"),
    [(9, 3, 64, 0), (12, 2, 64, 0), (16, 2, 128, 0), (9, 3, 64, 21)],
    ids=["smollm2", "group-6", "group-8-dim-128", "window"],
)
def test_decode_rows_with_whole_blocks_of_keys(heads, kv_heads, d, window, block_size):
    """Blocks as large as the engine's: scores are taken sixteen keys at a time and a
    block's values are read once for every query head of its group, in chunks of heads."""
    k_cache, v_cache = _cache(kv_heads, 24, block_size, d, torch.float32, seed=6)
    tables = [[7, 2, 20, 11, 5], [1, 23, 0, 0, 0], [15, 3, 17, 9, 0]]
    contexts = [5 * block_size - 3, 2 * block_size, 3 * block_size + 7]
    q = torch.randn(3, heads, d, generator=torch.Generator().manual_seed(7))
    out = _call(q, k_cache, v_cache, tables, [0, 1, 2], contexts, window)
    for r in range(3):
        want = _reference(q[r], k_cache, v_cache, tables[r], contexts[r], window)
        torch.testing.assert_close(out[r], want, rtol=1e-5, atol=1e-5)


def test_several_rows_of_one_sequence_are_causal_within_them():
    """1 + k rows sharing a block table, each seeing one more position: what causal attention
    over the whole context computes for the last 1 + k positions."""
    heads, kv_heads, d, block_size = 9, 3, 64, 4
    k_cache, v_cache = _cache(kv_heads, 16, block_size, d, torch.float32)
    table = [3, 9, 1, 12, 6]
    ctx, k = 18, 4
    q = torch.randn(1 + k, heads, d, generator=torch.Generator().manual_seed(2))
    rows = list(range(ctx - k, ctx + 1))
    out = _call(q, k_cache, v_cache, [table], [0] * (1 + k), rows)
    keys = k_cache[:, table].reshape(kv_heads, -1, d)[:, :ctx]
    values = v_cache[:, table].reshape(kv_heads, -1, d)[:, :ctx]
    mask = torch.arange(ctx).unsqueeze(0) < torch.tensor(rows).unsqueeze(1)
    want = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=mask, enable_gqa=True
    )
    torch.testing.assert_close(out, want.transpose(0, 1).reshape(1 + k, -1), rtol=1e-5, atol=1e-5)


def test_a_rows_result_does_not_depend_on_the_other_rows():
    k_cache, v_cache = _cache(3, 32, 4, 64, torch.float32)
    q = torch.randn(4, 9, 64, generator=torch.Generator().manual_seed(3))
    tables = [[5, 6, 7, 0], [1, 2, 0, 0], [9, 10, 11, 12], [20, 0, 0, 0]]
    together = _call(q, k_cache, v_cache, tables, [0, 1, 2, 3], [14, 7, 16, 2])
    alone = _call(q[2:3].contiguous(), k_cache, v_cache, [tables[2]], [0], [16])
    assert torch.equal(together[2], alone[0])  # bit for bit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches(dtype):
    k_cache, v_cache = _cache(4, 20, 4, 64, dtype)
    q = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    tables = [[3, 4, 5], [10, 11, 0]]
    out = _call(q, k_cache, v_cache, tables, [0, 1], [11, 6])
    assert out.dtype == dtype
    for r, ctx in enumerate([11, 6]):
        want = _reference(q[r], k_cache, v_cache, tables[r], ctx, 0)
        torch.testing.assert_close(out[r].float(), want, rtol=2e-2, atol=2e-2)


def test_bad_arguments_raise_naming_the_problem():
    k_cache, v_cache = _cache(2, 8, 4, 16, torch.float32)
    q = torch.randn(1, 4, 16)
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.serve_app.paged_decode_attention(
            q, k_cache, v_cache, torch.zeros(1, 2, dtype=torch.long),
            torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0, 0.25,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="dtype"):
        _call(q.double(), k_cache, v_cache, [[0, 1]], [0], [5])
    with pytest.raises(RuntimeError, match="one sequence and one context length per query row"):
        _call(q, k_cache, v_cache, [[0, 1]], [0, 0], [5, 5])


def _prefill_inputs(heads, kv_heads, d, q_len, ctx, seed=5):
    """q, k, v as the engine hands them over: per-head views of one QKV projection output
    for a first chunk, a gathered (kv_heads, ctx, d) prefix for a chunk after cached tokens."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(q_len, (heads + 2 * kv_heads) * d, generator=g)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    q = q.view(q_len, heads, d).transpose(0, 1)
    if ctx == q_len:
        k = k.view(q_len, kv_heads, d).transpose(0, 1)
        v = v.view(q_len, kv_heads, d).transpose(0, 1)
    else:
        k = torch.randn(kv_heads, ctx, d, generator=g)
        v = torch.randn(kv_heads, ctx, d, generator=g)
    return q, k, v


@pytest.mark.parametrize(
    ("heads", "kv_heads", "d"),
    [(9, 3, 64), (8, 4, 64), (4, 4, 128), (4, 1, 64)],
    ids=["smollm2", "bench", "mha-128", "mqa"],
)
@pytest.mark.parametrize(
    ("q_len", "ctx"),
    [(1, 1), (37, 37), (200, 200), (21, 70), (1, 33)],
    ids=["one-token", "block-edges", "long", "after-cached", "one-after-cached"],
)
def test_prefill_attention_matches_causal_sdpa(heads, kv_heads, d, q_len, ctx):
    q, k, v = _prefill_inputs(heads, kv_heads, d, q_len, ctx)
    scale = 1.0 / math.sqrt(d)
    # Query position i sees the cached prefix and the chunk up to itself.
    mask = torch.ones(q_len, ctx, dtype=torch.bool).tril(ctx - q_len)
    want = F.scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scale,
        enable_gqa=heads != kv_heads,
    )[0].transpose(0, 1).reshape(q_len, heads * d)  # fmt: skip
    out = torch.ops.serve_app.prefill_attention(q, k, v, scale)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_a_prefill_positions_result_does_not_depend_on_later_positions():
    q, k, v = _prefill_inputs(9, 3, 64, 150, 150)
    whole = torch.ops.serve_app.prefill_attention(q, k, v, 0.125)
    first = torch.ops.serve_app.prefill_attention(q[:, :61], k[:, :61], v[:, :61], 0.125)
    assert torch.equal(whole[:61], first)  # bit for bit


def test_prefill_attention_refuses_what_it_does_not_take():
    q, k, v = _prefill_inputs(8, 4, 64, 10, 10)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.serve_app.prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.1)
    q48, k48, v48 = _prefill_inputs(8, 4, 48, 10, 10)
    with pytest.raises(RuntimeError, match="head dims 64 and 128"):
        torch.ops.serve_app.prefill_attention(q48, k48, v48, 0.1)
    with pytest.raises(RuntimeError, match="more query positions than keys"):
        torch.ops.serve_app.prefill_attention(q, k[:, :5], v[:, :5], 0.1)


def test_cuda_keeps_torchs_ops_and_the_cpu_kernels_can_be_switched_off(monkeypatch):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert platform.inplace_decode_attention(cuda) is False
    assert platform.cpu_prefill_attention(cuda) is False
    assert platform.fused_cpu_ops(cuda) is False
    monkeypatch.setenv("SERVE_APP_DECODE_ATTENTION", "gather")
    monkeypatch.setenv("SERVE_APP_PREFILL_ATTENTION", "sdpa")
    monkeypatch.setenv("SERVE_APP_CPU_FUSED_OPS", "0")
    assert platform.inplace_decode_attention(cpu) is False
    assert platform.cpu_prefill_attention(cpu) is False
    assert platform.fused_cpu_ops(cpu) is False
    assert platform.cpu_sampler_kernels() is False


def _fused_and_reference(module, *args):
    """The module's torch path and its fused path on copies of the same inputs."""
    module.fused = False
    want = module(*[a.clone() for a in args])
    module.fused = True
    got = module(*[a.clone() for a in args])
    module.fused = False
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_small_ops_match_the_torch_modules(dtype):
    g = torch.Generator().manual_seed(5)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    norm.to(dtype)
    x = torch.randn(7, 576, generator=g).to(dtype)
    residual = torch.randn(7, 576, generator=g).to(dtype)
    got, want = _fused_and_reference(norm, x)
    torch.testing.assert_close(got, want, **tolerance)
    (got, got_res), (want, want_res) = _fused_and_reference(norm, x, residual)
    torch.testing.assert_close(got, want, **tolerance)
    assert torch.equal(got_res, want_res)  # x + residual, the same rounding

    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    rotary = RotaryEmbedding(64, 128, inv_freq, 1.0)
    qkv = torch.randn(5, 15 * 64, generator=g).to(dtype)  # q, k as views of the qkv rows
    positions = torch.tensor([0, 3, 50, 127, 7])
    rotary.fused = False
    want_q, want_k = rotary(positions, qkv[:, :576].view(5, 9, 64), qkv[:, 576:768].view(5, 3, 64))
    rotary.fused = True
    got_q, got_k = rotary(positions, qkv[:, :576].view(5, 9, 64), qkv[:, 576:768].view(5, 3, 64))
    torch.testing.assert_close(got_q, want_q, **tolerance)
    torch.testing.assert_close(got_k, want_k, **tolerance)

    gate_up = torch.randn(6, 2 * 96, generator=g).to(dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    got = torch.ops.serve_app.silu_and_mul(gate_up)
    torch.testing.assert_close(got, F.silu(gate) * up, **tolerance)


def test_bf16_rounding_in_the_fused_ops_is_torchs_for_every_value():
    # The kernels round fp32 to bf16 with their own vectorized code: ties to even, overflow to
    # inf and NaN must come out as torch's own rounding gives them.
    assert kernels.available()  # loads the operators
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(4, 576, generator=g) * 1e3).bfloat16()
    residual = torch.randn(4, 576, generator=g).bfloat16()
    specials = [float("nan"), float("inf"), -float("inf"), 3.3e38, -3.3e38, 1e-40]
    x[0, : len(specials)] = torch.tensor(specials)
    residual[0, : len(specials)] = torch.tensor([1.0, 1.0, 1.0, 3.3e38, -3.3e38, 1e-40])
    # Sums halfway between two bf16 values (spacing 2^-7 at 1.0): one rounds down to even, one up.
    x[1, :2] = torch.tensor([1.0, 1.0 + 2.0**-7])
    residual[1, :2] = 2.0**-8
    want = (x.float() + residual.float()).bfloat16()
    got_x, got_residual = x.clone(), residual.clone()
    torch.ops.serve_app.fused_add_rms_norm(got_x, got_residual, torch.ones(576).bfloat16(), 1e-5)
    nan = want.isnan()
    assert torch.equal(got_residual.isnan(), nan)  # a NaN's payload bits are not a value
    same_bits = got_residual.view(torch.int16)[~nan] == want.view(torch.int16)[~nan]
    assert bool(same_bits.all())  # bit for bit, ties, overflow and subnormals included
    assert got_residual[0, 3].isinf()


def test_the_model_uses_the_fused_ops_and_generates_what_the_torch_path_does(
    model_dirs, monkeypatch
):
    path = str(model_dirs("llama"))
    prompts = [list(range(30, 60)), list(range(5, 12))]
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=1, ignore_eos=True)
    runs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("SERVE_APP_CPU_FUSED_OPS", fused)
        llm = LLM(model=path)
        model = llm.engine.executor.worker.runner.model
        flags = [m.fused for m in model.modules() if isinstance(m, RMSNorm | LlamaMLP)]
        assert flags and all(f is (fused == "1") for f in flags)
        runs[fused] = [o.outputs[0] for o in llm.generate(prompts, params)]
        llm.shutdown()
    for got, want in zip(runs["1"], runs["0"], strict=True):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_a_failed_build_leaves_torchs_path(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path / "cache"))
    assert kernels.available() is False
    assert "using torch's ops" in caplog.text
    assert kernels.available() is False  # decided once per process


def _masked_reference(scores, bitmask, rows):
    """torch.argmax of each row with its forbidden tokens at -inf."""
    masked = masked_by_bits(scores, bitmask, rows)
    return [-1 if torch.isneginf(masked[r]).all() else int(masked[r].argmax()) for r in rows]


def _random_bitmask(g, rows, vocab, density):
    width = -(-vocab // 32)
    bits = torch.rand(rows, width * 32, generator=g) < density / 32
    words = (bits.view(rows, width, 32).long() << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("vocab", [49152, 49155, 70, 33, 5])
def test_the_grammar_mask_writes_only_the_forbidden_tokens_of_its_rows(vocab, kernel):
    """xgrammar's CPU mask could write one -inf past a row whose last word is partial: into
    the next row's tokens, and after the last row into the heap (a crash in 3 of 3 runs at
    vocab 33). The sampler's mask must stay inside each row it is given."""
    from actors.sampler import _apply_mask

    assert kernels.available()
    g = torch.Generator().manual_seed(vocab)
    for density in (1, 3, 30, 31):
        guard = 64
        memory = torch.randn(12 * vocab + guard, generator=g)
        before = memory.clone()
        scores = memory[: 12 * vocab].view(12, vocab)
        bitmask = _random_bitmask(g, 12, vocab, density)
        bitmask[4], bitmask[5] = 0, -1  # nothing allowed, everything allowed
        rows = [0, 1, 2, 4, 5, 7, 11]
        _apply_mask(scores, bitmask, rows, kernel)
        expected = masked_by_bits(before[: 12 * vocab].view(12, vocab), bitmask, rows)
        assert torch.equal(scores, expected), (vocab, density)
        assert torch.equal(memory[12 * vocab :], before[12 * vocab :])  # nothing past the rows


@pytest.mark.parametrize("vocab", [49152, 49155, 70, 33, 5])
def test_masked_argmax_is_the_argmax_of_the_masked_row(vocab):
    assert kernels.available()  # loads the operators
    g = torch.Generator().manual_seed(vocab)
    for density in (1, 3, 30, 31):  # of 32 bits allowed, on average
        scores = torch.randn(12, vocab, generator=g)
        scores[1] = torch.randint(0, 3, (vocab,), generator=g).float()  # many ties
        scores[2, : vocab // 2] = float("-inf")
        scores[3] = float("-inf")
        bitmask = _random_bitmask(g, 12, vocab, density)
        bitmask[4] = 0  # nothing allowed
        bitmask[5] = -1  # everything allowed
        rows = [0, 1, 2, 3, 4, 5, 7, 11]
        got = torch.ops.serve_app.masked_argmax(scores, bitmask, torch.tensor(rows)).tolist()
        assert got == _masked_reference(scores, bitmask, rows), (vocab, density)
        assert got[3] == -1 and got[4] == -1


def test_masked_argmax_reads_rows_in_place_and_tokens_past_the_bitmask_stay_allowed():
    assert kernels.available()
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(6, 100, generator=g)
    bitmask = torch.zeros(6, 3, dtype=torch.int32)  # covers tokens 0..95 and forbids them all
    bitmask[1, 0] = 1 << 4  # what row 1 of the call (scores row 2) allows
    scores[2, 4], scores[2, 97] = 50.0, 40.0
    view = scores[::2]  # rows 0, 2, 4 of scores: a strided batch
    got = torch.ops.serve_app.masked_argmax(view, bitmask[:3], torch.tensor([0, 1, 2]))
    assert got[1] == 4  # the allowed token, not the larger one past the bitmask
    assert got.tolist() == [int(scores[r, 96:].argmax()) + 96 for r in (0,)] + [4] + [
        int(scores[4, 96:].argmax()) + 96
    ]
    # The mask writes through the same strided view: rows 0, 2, 4 only, up to the bitmask.
    before = scores.clone()
    torch.ops.serve_app.apply_bitmask(view, bitmask[:3], torch.tensor([0, 1, 2]))
    assert torch.equal(scores[1::2], before[1::2]) and torch.equal(scores[:, 96:], before[:, 96:])
    assert torch.isneginf(scores[::2, :96]).sum() == 3 * 96 - 1 and scores[2, 4] == 50.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [49152, 49155, 70, 1])
def test_argmax_rows_is_torchs_argmax(dtype, vocab):
    assert kernels.available()
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(12, vocab + 3, generator=g).to(dtype)[:, :vocab]  # rows of a wider tensor
    x[1] = torch.randint(0, 3, (vocab,), generator=g).to(dtype)  # many ties: the first wins
    x[2] = float("-inf")
    x[3, vocab // 2] = float("nan")  # torch ranks NaN above every number...
    x[4, vocab - 1] = float("nan")
    x[4, 0] = float("inf")  # ...and above inf
    x[5, vocab // 3] = float("inf")
    x[5, vocab // 2] = float("inf")
    x[6] = 7.0  # a constant row
    got = torch.ops.serve_app.argmax_rows(x)
    assert got.dtype == torch.int64
    assert got.tolist() == x.argmax(dim=-1).tolist()


def test_argmax_rows_refuses_what_it_does_not_take():
    assert kernels.available()
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        torch.ops.serve_app.argmax_rows(torch.randn(2, 8).double())
    with pytest.raises(RuntimeError, match="unit stride"):
        torch.ops.serve_app.argmax_rows(torch.randn(8, 2).t())
    with pytest.raises(RuntimeError, match="n > 0"):
        torch.ops.serve_app.argmax_rows(torch.randn(2, 0))


def test_the_grammar_ops_refuse_what_they_do_not_take():
    assert kernels.available()
    scores, bitmask = torch.randn(2, 64), torch.full((2, 2), -1, dtype=torch.int32)
    rows = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="scores must be float32"):
        torch.ops.serve_app.masked_argmax(scores.double(), bitmask, rows)
    with pytest.raises(RuntimeError, match="bitmask must be int32"):
        torch.ops.serve_app.masked_argmax(scores, bitmask.long(), rows)
    with pytest.raises(RuntimeError, match="outside scores or bitmask"):
        torch.ops.serve_app.masked_argmax(scores, bitmask[:1], rows)
    with pytest.raises(RuntimeError, match="rows must be"):
        torch.ops.serve_app.masked_argmax(scores, bitmask, rows.int())
    with pytest.raises(RuntimeError, match="outside scores or bitmask"):
        torch.ops.serve_app.apply_bitmask(scores, bitmask, torch.tensor([2]))
    with pytest.raises(RuntimeError, match="scores must be float32"):
        torch.ops.serve_app.apply_bitmask(scores.half(), bitmask, rows)


@pytest.mark.parametrize("n,k", [(1, 1), (31, 7), (32, 64), (33, 64), (70, 576), (96, 1536)])
def test_panel_linear_matches_f_linear(n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    weight = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    panels = torch.ops.serve_app.pack_panels(weight)
    assert panels.shape == ((n + 31) // 32, k, 32)
    for rows in (0, 1, 3, 12, 13, 25, 40, 128):
        x = torch.randn(rows, k, generator=g)
        want = F.linear(x, weight)
        tol = dict(rtol=1e-5, atol=1e-5 * math.sqrt(k))
        torch.testing.assert_close(torch.ops.serve_app.panel_linear(x, panels, n), want, **tol)
        got = torch.ops.serve_app.panel_linear(x, panels, n, bias)
        torch.testing.assert_close(got, want + bias, **tol)


def test_panel_linear_reads_rows_of_a_wider_tensor():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 20, generator=g)
    wide = torch.randn(6, 50, generator=g)
    x = wide[:, 5:25]  # row stride 50
    got = torch.ops.serve_app.panel_linear(x, torch.ops.serve_app.pack_panels(weight), 48)
    torch.testing.assert_close(got, F.linear(x.contiguous(), weight), rtol=1e-5, atol=1e-5)


def test_a_panel_linear_rows_result_does_not_depend_on_the_other_rows():
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(100, 96, generator=g)
    panels = torch.ops.serve_app.pack_panels(weight)
    x = torch.randn(32, 96, generator=g)
    alone = torch.ops.serve_app.panel_linear(x[:1], panels, 100)
    for rows in range(2, 33):
        # Bit for bit: every output is summed over k in the same order, however rows group.
        assert torch.equal(torch.ops.serve_app.panel_linear(x[:rows], panels, 100)[:1], alone)


def test_panel_linear_refuses_what_it_does_not_take():
    panels = torch.ops.serve_app.pack_panels(torch.randn(40, 8))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.serve_app.panel_linear(torch.randn(2, 8, dtype=torch.bfloat16), panels, 40)
    with pytest.raises(RuntimeError, match="input features"):
        torch.ops.serve_app.panel_linear(torch.randn(2, 9), panels, 40)
    with pytest.raises(RuntimeError, match="does not match the panels"):
        torch.ops.serve_app.panel_linear(torch.randn(2, 8), panels, 70)
    with pytest.raises(RuntimeError, match="unit stride"):
        torch.ops.serve_app.panel_linear(torch.randn(8, 2).t(), panels, 40)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.serve_app.panel_linear(torch.randn(2, 8), panels, 40, torch.randn(39))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.serve_app.pack_panels(torch.randn(4, 4, dtype=torch.float16))


BF16_PANELS = [(1, 2), (31, 8), (32, 64), (33, 64), (70, 576), (96, 1536)]


@pytest.mark.parametrize("n,k", BF16_PANELS)
def test_bf16_panels_match_f_linear_or_are_refused_without_amx(n, k):
    assert kernels.available()
    g = torch.Generator().manual_seed(n * 1000 + k)
    weight = torch.randn(n, k, generator=g).bfloat16()
    if not torch.ops.serve_app.panel_linear_bf16():
        with pytest.raises(RuntimeError, match="AMX"):
            torch.ops.serve_app.pack_panels(weight)
        return
    bias = torch.randn(n, generator=g).bfloat16()
    panels = torch.ops.serve_app.pack_panels(weight)
    assert panels.shape == ((n + 31) // 32, k, 32) and panels.dtype == torch.bfloat16
    for rows in (0, 1, 3, 4, 12, 16, 17, 25, 32, 40):
        x = torch.randn(rows, k, generator=g).bfloat16()
        # fp32 sums of the exact products, each output rounded to bf16 once.
        want = F.linear(x.float(), weight.float())
        tol = dict(rtol=1e-2, atol=1e-3 * math.sqrt(k))
        got = torch.ops.serve_app.panel_linear(x, panels, n)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, **tol)
        got = torch.ops.serve_app.panel_linear(x, panels, n, bias)
        torch.testing.assert_close(got.float(), (want.bfloat16() + bias).float(), **tol)


def test_a_bf16_panel_rows_result_does_not_depend_on_the_other_rows():
    assert kernels.available()
    if not torch.ops.serve_app.panel_linear_bf16():
        assert not platform.use_panel_linear(torch.device("cpu"), torch.bfloat16)
        return
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(100, 96, generator=g).bfloat16()
    panels = torch.ops.serve_app.pack_panels(weight)
    wide = torch.randn(32, 100, generator=g).bfloat16()
    x = wide[:, :96]  # rows of a wider tensor
    alone = torch.ops.serve_app.panel_linear(x[:1], panels, 100)
    for rows in range(2, 33):
        assert torch.equal(torch.ops.serve_app.panel_linear(x[:rows], panels, 100)[:1], alone)
    with pytest.raises(RuntimeError, match="even number"):
        torch.ops.serve_app.pack_panels(torch.randn(40, 7).bfloat16())
    with pytest.raises(RuntimeError, match="alike"):
        torch.ops.serve_app.panel_linear(torch.randn(2, 96), panels, 100)
