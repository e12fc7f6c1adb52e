"""Checkpoint shapes for the model factory: plain data, cheap to import (the CLI lists them)."""

from __future__ import annotations

from dataclasses import dataclass

ARCHS = ("llama", "qwen2", "mistral")
PRESETS = ("tiny", "bench")


@dataclass(frozen=True)
class Preset:
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    vocab_size: int  # target; the tokenizer may come out smaller on a small corpus
    # NOTE: far above the usual 0.02 on purpose. Near-uniform logits make greedy top-1 ties
    # that fp32 rounding breaks differently between implementations, which ruins parity tests.
    # ~1.2 / sqrt(hidden_size) gives logits with a standard deviation of about one.
    initializer_range: float
    mistral_sliding_window: int
    # Variants that only the tiny preset exercises, so parity tests cover them cheaply.
    llama_rope_scaled: bool
    qwen2_tied_embeddings: bool
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6


PRESET_SPECS: dict[str, Preset] = {
    "tiny": Preset(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=1024,
        vocab_size=2048,
        initializer_range=0.15,
        mistral_sliding_window=64,
        llama_rope_scaled=True,
        qwen2_tied_embeddings=True,
    ),
    "bench": Preset(
        num_hidden_layers=8,
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1408,
        max_position_embeddings=2048,
        vocab_size=8192,
        initializer_range=0.05,
        mistral_sliding_window=1024,
        llama_rope_scaled=False,
        qwen2_tied_embeddings=False,
    ),
}

# Llama 3.x-style scaled rotary on the tiny llama. With head_dim 16 and theta 1e4 the rotary
# wavelengths run from ~6 to ~2e4 positions, so the 64/256 thresholds put frequencies in all
# three bands (kept, smoothed, divided by `factor`).
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
