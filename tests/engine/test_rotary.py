"""The RoPE frequencies computed in actors/layers/rotary.py (default, linear and Llama 3.1
scaling) are bit for bit the ones transformers computes for the same config.json; variants
computed by transformers stay there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from actors.layers.rotary import inv_freq_and_scale
from tests.support.fresh_python import run_python

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
CASES = [
    (64, {"rope_type": "default", "rope_theta": 10000.0}),
    (128, {**LLAMA3, "rope_theta": 500000.0}),  # Llama 3.1 8B
    (64, {**LLAMA3, "factor": 32.0, "rope_theta": 500000.0}),  # Llama 3.2 1B
    (32, {**LLAMA3, "original_max_position_embeddings": 256, "rope_theta": 10000.0}),
    (48, {**LLAMA3, "low_freq_factor": 2.0, "high_freq_factor": 8.0, "rope_theta": 1e6}),
    (64, {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    (64, {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
          "original_max_position_embeddings": 2048}),
]  # fmt: skip


def write_config(folder: Path, head_dim: int, rope: dict) -> Path:
    folder.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": head_dim * 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        "vocab_size": 128,
        "max_position_embeddings": 4 * rope.get("original_max_position_embeddings", 2048),
        "rope_parameters": rope,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(("head_dim", "rope"), CASES, ids=[c[1]["rope_type"] for c in CASES])
def test_frequencies_are_transformers_own(head_dim, rope, tmp_path):
    folder = write_config(tmp_path / "model", head_dim, rope)
    ours, scale = inv_freq_and_scale(str(folder), head_dim, dict(rope))
    # What transformers' Llama itself rotates with.
    theirs = LlamaRotaryEmbedding(AutoConfig.from_pretrained(folder))
    assert ours.dtype == torch.float32 and ours.shape == (head_dim // 2,)
    assert torch.equal(ours, theirs.inv_freq.float()), (ours - theirs.inv_freq).abs().max()
    assert scale == float(theirs.attention_scaling)


def test_a_llama3_scaled_engine_builds_without_transformers_configs(model_dirs):
    """An engine process (replica, rank, batch actor) no longer imports transformers' config
    classes for the tiny llama's Llama 3.1 scaling."""
    code = (
        "import sys\n"
        "from actors.config import ModelConfig\n"
        "from actors.layers.rotary import inv_freq_and_scale\n"
        "import torch\n"
        f"config = ModelConfig.from_pretrained({str(model_dirs('llama'))!r}, dtype=torch.float32)\n"
        "assert config.rope_parameters['rope_type'] == 'llama3'\n"
        "inv_freq_and_scale(config.path, config.head_dim, config.rope_parameters)\n"
        "print('transformers.configuration_utils' in sys.modules)\n"
    )
    assert run_python(code) == "False"
