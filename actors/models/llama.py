"""Llama-family decoder (Llama, Qwen2 with qkv bias, Mistral with a sliding window).

Written as single-device code on tensor-parallel layers: with one rank every collective is a
no-op; with more, each layer holds its shard and all-reduces where the math needs it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from actors.config import ModelConfig
from actors.forward_context import get_forward_context
from actors.layers.attention import AttentionBackend
from actors.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from actors.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from actors.layers.norm import RMSNorm
from actors.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, d, config.num_heads, config.num_kv_heads, bias=config.qkv_bias
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size, what="num_heads")
        self.rotary = rotary
        self.backend = backend

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        d = self.head_dim
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], -1)
        q = q.view(-1, self.num_heads, d)
        k = k.view(-1, self.num_kv_heads, d)
        v = v.view(-1, self.num_kv_heads, d)
        q, k = self.rotary(positions, q, k)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], get_forward_context())
        return self.o_proj(o)


class LlamaMLP(nn.Module):
    # Set on CPU by `actors.layers.fused.use_fused_ops`: SiLU and the product in one pass.
    fused = False

    def __init__(self, config: ModelConfig):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size])
        self.down_proj = RowParallelLinear(size, config.hidden_size, what="intermediate size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused:
            return self.down_proj(torch.ops.serve_app.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, backend)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual, kv_cache):
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary, backend) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches):
        x = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # HF checkpoint names -> (our fused parameter, shard id)
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, rotary, backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches) -> torch.Tensor:
        """(num_tokens,) ids and positions -> (num_tokens, hidden) final hidden states."""
        return self.model(input_ids, positions, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
