"""Engine configuration: one frozen dataclass per concern, validated at construction."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch at run time only where weights load: a driver's check reads JSON
    import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """Normalise old (`rope_theta` + `rope_scaling`) and new (`rope_parameters`) spellings."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    return params


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a checkpoint; read from its `config.json`."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    # Maximum tokens per sequence (prompt + output); defaults to max_position_embeddings.
    max_model_len: int
    rope_parameters: dict[str, Any] = field(hash=False, compare=False)
    tie_word_embeddings: bool = False
    # Qwen2 has biases on q/k/v projections.
    qkv_bias: bool = False
    # Mistral-style sliding window over keys; None means full attention.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # The weights' dtype; None for a config only read to check it (a batch job's driver).
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; "
                f"expected one of {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if not 0 < self.max_model_len <= self.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) must be in "
                f"[1, max_position_embeddings={self.max_position_embeddings}]"
            )

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype | None, max_model_len: int | None = None
    ) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model: {path} has no config.json")
        raw = json.loads(config_file.read_text())
        architecture = (raw.get("architectures") or ["?"])[0]
        num_heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        max_pos = raw.get("max_position_embeddings", 2048)
        sliding = raw.get("sliding_window")
        if architecture == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
            sliding = None
        eos = _eos_token_ids(path, raw)
        return cls(
            path=str(path),
            architecture=architecture,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=max_pos,
            max_model_len=max_model_len or max_pos,
            rope_parameters=_rope_parameters(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=architecture == "Qwen2ForCausalLM" or bool(raw.get("attention_bias")),
            sliding_window=sliding,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos,
            dtype=dtype,
        )


def _eos_token_ids(path: Path, raw: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids from generation_config.json (which may list several), else config.json."""
    ids: list[int] = []
    gen_file = path / "generation_config.json"
    for source in (json.loads(gen_file.read_text()) if gen_file.is_file() else {}, raw):
        value = source.get("eos_token_id")
        if value is None:
            continue
        for token_id in value if isinstance(value, list) else [value]:
            if token_id not in ids:
                ids.append(int(token_id))
    return tuple(ids)


@dataclass(frozen=True)
class CacheConfig:
    # Tokens per KV block; None: the platform's default (`platform.default_block_size`:
    # 128 on CPU, 16 on CUDA), settled by the engine core once it knows where its ranks run.
    block_size: int | None = None
    # Bytes of KV cache per rank; ignored when num_blocks is set.
    memory_budget_bytes: int = 512 * 1024**2
    # Exact number of blocks (tests use it to force preemption).
    num_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size is not None and (
            self.block_size < 1 or self.block_size & (self.block_size - 1)
        ):
            raise ValueError(f"block_size ({self.block_size}) must be a power of two")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks ({self.num_blocks}) must be >= 1")
        if self.memory_budget_bytes < 1:
            raise ValueError("memory_budget_bytes must be positive")

    def settled(self, on_gpu: bool) -> CacheConfig:
        """This config with its block size decided: the operator's, else the platform's."""
        if self.block_size is not None:
            return self
        from actors.platform import default_block_size

        return replace(self, block_size=default_block_size(on_gpu))


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # STRICT_PACK keeps every rank on one node; PACK or SPREAD let ranks straddle nodes
    # (collectives over the network), which is an opt-in.
    placement_strategy: str = "STRICT_PACK"
    # How long to wait for the placement group before failing with a message.
    placement_timeout_s: float = 60.0
    # One GPU per rank; None: whether the Ray cluster has GPUs when the executor starts.
    use_gpu: bool | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) must be >= 1")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"placement_strategy {self.placement_strategy!r} is not one of "
                + ", ".join(PLACEMENT_STRATEGIES)
            )
        if self.placement_timeout_s <= 0:
            raise ValueError(f"placement_timeout_s ({self.placement_timeout_s}) must be > 0")


def check_tensor_parallel(model: ModelConfig, tp: int) -> None:
    """Fail at startup, naming the numbers, when `tp` cannot shard this model."""
    problems = []
    if model.num_heads % tp:
        problems.append(f"num_attention_heads ({model.num_heads})")
    if model.num_kv_heads >= tp and model.num_kv_heads % tp:
        problems.append(f"num_key_value_heads ({model.num_kv_heads})")
    if model.num_kv_heads < tp and tp % model.num_kv_heads:
        problems.append(f"a multiple of num_key_value_heads ({model.num_kv_heads}) for replication")
    if model.intermediate_size % tp:
        problems.append(f"intermediate_size ({model.intermediate_size})")
    if problems:
        raise ValueError(f"tensor_parallel_size ({tp}) does not divide " + ", ".join(problems))


# A step's token budget by default: vLLM's CPU API server's default too. Measured against it
# on the trained model at 16 and 64 streams (docs/benchmarks.md): 1,024 spread new prompts over
# more steps, each stalling every running stream (TPOT p50 1.26x and 1.15x of vLLM's); 4,096
# made TPOT 0.91x and 0.96x but throughput fell to 0.87x at 64 (a 4,096-token prefill's
# activations spill this CPU's caches); 2,048 kept throughput and made TPOT 0.99x and 1.07x.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class SchedulerConfig:
    # Most sequences in one step's batch.
    max_num_seqs: int = 64
    # Token budget of one step: decode tokens plus prefill chunks.
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    # Split long prompts into chunks under the budget instead of waiting for room.
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs ({self.max_num_seqs}) must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )
