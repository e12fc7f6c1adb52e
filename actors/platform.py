"""Every device choice in one place: which device, which dtype, which collective backend.

The device follows torch (`torch.cuda.is_available()`), never Ray's resource labels: a Ray
task given a fake GPU still runs on CPU here.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def is_cuda() -> bool:
    return torch.cuda.is_available()


def device_for_rank(local_rank: int = 0) -> torch.device:
    if is_cuda():
        # Ray sets CUDA_VISIBLE_DEVICES per worker, so the visible index is usually 0.
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def default_dtype() -> torch.dtype:
    """fp32 on CPU (exact parity, fast enough); bf16 on CUDA."""
    return torch.bfloat16 if is_cuda() else torch.float32


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype()
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def use_prepacked_linear(device: torch.device) -> bool:
    """CPU linear layers through oneDNN with packed weights (actors/layers/prepack.py), unless
    `SERVE_APP_CPU_PREPACK=0`. CUDA keeps cuBLAS through F.linear."""
    if device.type != "cpu" or os.environ.get("SERVE_APP_CPU_PREPACK", "1") == "0":
        return False
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


# Rows up to which a CPU linear layer runs the engine's panel kernel instead of oneDNN
# (actors/layers/prepack.py), by dtype: decode batch sizes, where the layer is a read of its
# weight. bf16 (on AMX) to 32: a bf16 decode of the trained model, 1 thread, made 1.34x / 1.31x
# / 1.26x / 1.22x / 1.17x oneDNN's tokens/s at 1 / 4 / 8 / 16 / 32 sequences, the same at 48
# and 0.90x at 64.
PANEL_LINEAR_MAX_ROWS = {torch.float32: 128, torch.bfloat16: 32}


def use_panel_linear(device: torch.device, dtype: torch.dtype) -> bool:
    """CPU linear layers at up to `PANEL_LINEAR_MAX_ROWS[dtype]` rows through the engine's
    panel kernel (actors/csrc/panel_linear.cpp): fp32, and bf16 where the CPU has AMX (and
    Linux grants its tile state; elsewhere bf16 keeps oneDNN), unless
    `SERVE_APP_CPU_PANEL_LINEAR=0` or the kernels cannot be built here. CUDA keeps cuBLAS."""
    if device.type != "cpu" or dtype not in PANEL_LINEAR_MAX_ROWS:
        return False
    if os.environ.get("SERVE_APP_CPU_PANEL_LINEAR", "1") == "0":
        return False
    from actors.layers import kernels

    if not kernels.available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.serve_app.panel_linear_bf16())


def persistent_decode_gather(device: torch.device) -> bool:
    """Keep each decode bucket's gathered K/V between steps and copy in only the blocks that
    changed (actors/layers/attention.py), unless `SERVE_APP_DECODE_GATHER_REUSE=0`. CPU only:
    the buffers are extra memory that the CUDA KV budget (sized from free memory) leaves no
    room for."""
    return device.type == "cpu" and os.environ.get("SERVE_APP_DECODE_GATHER_REUSE", "1") != "0"


def inplace_decode_attention(device: torch.device) -> bool:
    """Decode attention through the engine's own CPU kernel, which reads the paged KV cache
    in place (actors/csrc/paged_attention.cpp), unless `SERVE_APP_DECODE_ATTENTION=gather`
    or the kernel cannot be built here. CUDA keeps torch's kernels (gathers and matmuls)."""
    if device.type != "cpu" or os.environ.get("SERVE_APP_DECODE_ATTENTION", "") == "gather":
        return False
    from actors.layers import kernels

    return kernels.available()


def cpu_prefill_attention(device: torch.device) -> bool:
    """fp32 prefill attention through the engine's own CPU kernel
    (actors/csrc/prefill_attention.cpp: causal over the chunk's cached prefix, each key and
    value loaded once for its whole group of query heads), unless
    `SERVE_APP_PREFILL_ATTENTION=sdpa` or the kernels cannot be built here. Other dtypes,
    head dims and windowed chunks, and CUDA, keep torch's SDPA."""
    if device.type != "cpu" or os.environ.get("SERVE_APP_PREFILL_ATTENTION", "") == "sdpa":
        return False
    from actors.layers import kernels

    return kernels.available()


def fused_cpu_ops(device: torch.device) -> bool:
    """RMSNorm (with its residual add), rotary and SiLU-and-mul each as one pass of the
    engine's own CPU kernels (actors/csrc/fused_ops.cpp) instead of a chain of torch ops,
    unless `SERVE_APP_CPU_FUSED_OPS=0` or the kernels cannot be built here. CUDA keeps
    torch's ops."""
    if device.type != "cpu" or os.environ.get("SERVE_APP_CPU_FUSED_OPS", "1") == "0":
        return False
    from actors.layers import kernels

    return kernels.available()


def cpu_sampler_kernels() -> bool:
    """The sampler's own CPU kernels (actors/csrc/fused_ops.cpp): a greedy batch's argmax in
    one vectorized read of each row (`argmax_rows`; aten's is a scalar loop over bf16 logits,
    2.6 ms a step at 16 rows of a 49k vocabulary); a constrained row whose winner its grammar
    forbids re-picked by `masked_argmax` (the largest allowed score in one read of the row)
    instead of an in-place mask, an argmax and an all-masked check; rows that need the masked
    distribution masked by `apply_bitmask`. Unless `SERVE_APP_CPU_FUSED_OPS=0` or the kernels
    cannot be built here (then torch's ops, and torch unpacks the bits). Each kernel runs only
    on CPU tensors."""
    return fused_cpu_ops(torch.device("cpu"))


# Tokens per KV block when the operator names none. On CPU a block of one KV head is
# `block_size * head_dim` contiguous values, and decode attention reads each sequence's blocks
# from wherever they lie: at 16 tokens (4 KB in fp32 at head_dim 64) every block is a jump to
# another page, and the reads ran at ~10 GB/s against ~16 for 128-token blocks on this
# repository's machine (30 layers, 64 sequences of 128 tokens). vLLM's CPU backend makes the
# same choice (128). CUDA keeps 16: its kernels gather in parallel and memory is scarcer.
CPU_BLOCK_SIZE = 128
CUDA_BLOCK_SIZE = 16


def default_block_size(on_gpu: bool) -> int:
    """The KV block size for an engine whose ranks run on GPUs (`on_gpu`) or on CPUs."""
    return CUDA_BLOCK_SIZE if on_gpu else CPU_BLOCK_SIZE


def distributed_backend() -> str:
    return "nccl" if is_cuda() else "gloo"


def kv_cache_budget_bytes(requested: int, device: torch.device) -> int:
    """On CUDA use most of the free memory left after weights; on CPU the requested budget."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * float(os.environ.get("SERVE_APP_GPU_MEMORY_FRACTION", "0.85")))
    return requested


def describe() -> str:
    if is_cuda():
        return f"cuda ({torch.cuda.get_device_name(0)})"
    return f"cpu ({torch.get_num_threads()} threads)"
