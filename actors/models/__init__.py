from __future__ import annotations

from actors.models.llama import LlamaForCausalLM

# Qwen2 and Mistral differ from Llama only in what ModelConfig carries (bias, window).
MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}

__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM"]
