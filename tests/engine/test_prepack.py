"""CPU linear layers through oneDNN with packed weights, and in fp32 through the engine's
panel kernel at a few rows (actors/layers/prepack.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.config import ModelConfig
from actors.layers import prepack
from actors.layers.attention import TorchPagedAttention
from actors.models.loader import build_model
from actors.parallel_state import ensure_single_rank_group
from actors.platform import PANEL_LINEAR_MAX_ROWS


def _build(path, dtype=torch.float32):
    ensure_single_rank_group()
    config = ModelConfig.from_pretrained(str(path), dtype=dtype)
    backend = TorchPagedAttention(config.num_heads, config.num_kv_heads, config.head_dim)
    return build_model(config, backend, torch.device("cpu"))


def _layers(model):
    return [m for m in model.modules() if hasattr(m, "packed_weight")]


def _products(model, seed=0):
    """Every layer's output on random inputs of a few rows (the panel kernel's calls in fp32)
    and of more (oneDNN's): what the packing must not change."""
    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.inference_mode():
        for rows in (2, 5, PANEL_LINEAR_MAX_ROWS[torch.float32] + 8):
            for layer in _layers(model):
                x = torch.randn(rows, layer.weight.shape[1], generator=g, dtype=model_dtype(model))
                out.append(layer(x).float())
    return out


def _dense(monkeypatch):
    monkeypatch.setenv("SERVE_APP_CPU_PREPACK", "0")
    monkeypatch.setenv("SERVE_APP_CPU_PANEL_LINEAR", "0")


def model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_layers_hold_one_packed_copy_and_match_the_dense_path(
    model_dirs, monkeypatch, dtype
) -> None:
    packed = _build(model_dirs("llama"), dtype)
    layers = _layers(packed)
    # qkv, o, gate_up, down per layer, and the LM head.
    assert len(layers) == 4 * packed.config.num_layers + 1
    # oneDNN packs bf16 only on CPUs with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; elsewhere the
    # whole model must stay on the dense path (and still match it below).
    can_pack = dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    for layer in layers:
        if can_pack:
            assert layer.packed_weight is not None and layer.packed_weight.is_mkldnn
            assert layer.weight.is_mkldnn  # not tied: no dense copy is kept
        else:
            assert layer.packed_weight is None and not layer.weight.is_mkldnn
        # Layers also hold their weight in panels for calls of a few rows: fp32 ones, and bf16
        # ones where the CPU has AMX.
        panels = dtype == torch.float32 or torch.ops.serve_app.panel_linear_bf16()
        assert (layer.panel_weight is not None) is panels
    _dense(monkeypatch)
    dense = _build(model_dirs("llama"), dtype)
    for layer in _layers(dense):
        assert layer.packed_weight is None and not layer.weight.is_mkldnn
        assert layer.panel_weight is None
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in zip(_products(packed), _products(dense), strict=True):
        assert (got - want).abs().max() <= tolerance * want.abs().max()
    # The shapes a rank reports (shard_info) are the logical ones either way.
    shapes = {n: tuple(p.shape) for n, p in packed.named_parameters()}
    assert shapes == {n: tuple(p.shape) for n, p in dense.named_parameters()}


def test_tied_head_keeps_the_dense_embedding(model_dirs) -> None:
    model = _build(model_dirs("qwen2"))
    head, embed = model.lm_head, model.model.embed_tokens
    assert head.weight is embed.weight and not embed.weight.is_mkldnn
    assert head.packed_weight is not None and head.packed_weight.is_mkldnn
    assert head.panel_weight is not None
    with torch.inference_mode():
        hidden = torch.randn(3, embed.weight.shape[1])
        want = torch.nn.functional.linear(hidden, embed.weight)[:, : head.vocab_size]
        assert torch.allclose(model.compute_logits(hidden), want, rtol=1e-4, atol=1e-4)
        ids = torch.tensor([1, 2, 3])
        assert torch.equal(embed(ids), embed.weight[ids])


@pytest.mark.parametrize(
    "packer,lost,kept,logged",
    [
        ("_pack", "packed_weight", "panel_weight", "oneDNN packing failed (boom)"),
        ("_panels", "panel_weight", "packed_weight", "off the panel kernel: packing failed (boom)"),
    ],
)
def test_a_failed_packing_keeps_the_other_path_for_the_whole_model(
    model_dirs, monkeypatch, caplog, packer, lost, kept, logged
) -> None:
    def fail(weight):
        raise RuntimeError("boom")

    monkeypatch.setattr(prepack, packer, fail)
    model = _build(model_dirs("llama"))
    assert all(getattr(layer, lost) is None for layer in _layers(model))
    assert all(getattr(layer, kept) is not None for layer in _layers(model))
    assert logged in caplog.text
    assert all(torch.isfinite(p).all() for p in _products(model))


def test_packing_is_checked_against_f_linear(monkeypatch) -> None:
    weight = torch.randn(16, 8)
    real = prepack.linear

    def wrong(x, w, bias=None, packed=None):
        return real(x, w, bias, packed) + (1.0 if packed is not None else 0.0)

    monkeypatch.setattr(prepack, "linear", wrong)
    with pytest.raises(RuntimeError, match="differs from F.linear"):
        prepack._pack(weight)


def test_packing_leaves_the_global_rng_alone(model_dirs) -> None:
    torch.manual_seed(1234)
    want = torch.rand(4)
    torch.manual_seed(1234)
    _build(model_dirs("llama"))
    assert torch.equal(torch.rand(4), want)


def test_a_few_rows_go_through_the_panels_and_more_through_onednn() -> None:
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 24, generator=g)
    # Panels of twice the weight: which form answered shows in the result.
    doubled = torch.ops.serve_app.pack_panels(weight * 2)
    packed = prepack._pack(weight)
    most = PANEL_LINEAR_MAX_ROWS[torch.float32]
    for rows in (1, most, most + 1):
        x = torch.randn(rows, 24, generator=g)
        got = prepack.linear(x, weight, packed=packed, panels=doubled)
        scale = 2.0 if rows <= most else 1.0
        torch.testing.assert_close(got, scale * F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_the_panels_match_the_dense_layer_with_a_bias(model_dirs, monkeypatch) -> None:
    # qwen2 has a qkv bias: the panel kernel adds it.
    model = _build(model_dirs("qwen2"))
    _dense(monkeypatch)
    dense = _build(model_dirs("qwen2"))
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    for got, want in zip(_products(model), _products(dense), strict=True):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
