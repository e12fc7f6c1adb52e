"""Load HF safetensors into our (possibly sharded) model, one lazy slice at a time."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from actors.config import ModelConfig
from actors.layers.attention import AttentionBackend
from actors.layers.fused import use_fused_ops
from actors.layers.linear import default_weight_loader
from actors.layers.prepack import prepack_linears
from actors.layers.rotary import RotaryEmbedding, inv_freq_and_scale
from actors.models import MODEL_REGISTRY

_SKIP = re.compile(r"rotary_emb\.inv_freq$")


def build_model(config: ModelConfig, backend: AttentionBackend, device: torch.device) -> nn.Module:
    inv_freq, scale = inv_freq_and_scale(config.path, config.head_dim, config.rope_parameters)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        # Parameters are created where they will live; only shards are copied in.
        with torch.device(device):
            rotary = RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, inv_freq.to(device), scale
            )
            model = MODEL_REGISTRY[config.architecture](config, rotary, backend)
    finally:
        torch.set_default_dtype(previous)
    load_weights(model, config)
    model.eval().requires_grad_(False)
    prepack_linears(model, device, config.dtype)
    use_fused_ops(model, device)
    return model


def load_weights(model: nn.Module, config: ModelConfig) -> None:
    files = sorted(Path(config.path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {config.path}")
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    stacked = getattr(model, "stacked_params", {})
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if _SKIP.search(name):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                target, shard_id = name, None
                for hf_part, (ours, sid) in stacked.items():
                    if f".{hf_part}." in name:
                        target, shard_id = name.replace(f".{hf_part}.", f".{ours}."), sid
                        break
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, f.get_slice(name), shard_id)
                loaded.add(target)
    expected = {n for n in params if not (config.tie_word_embeddings and n == "lm_head.weight")}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {', '.join(missing[:5])}")
