"""Every device choice is in actors/platform.py: on CUDA the engine keeps torch's own kernels
(cuBLAS through F.linear, no kept decode gathers, NCCL, bf16 by default) whatever the CPU path
adds. Checked on CPU by asking the platform about a CUDA device."""

from __future__ import annotations

import pytest
import torch

from actors import platform


def test_cuda_keeps_torchs_kernels_and_the_cpu_path_has_its_own():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert platform.use_prepacked_linear(cuda) is False
    assert platform.use_panel_linear(cuda, torch.float32) is False
    assert platform.persistent_decode_gather(cuda) is False
    # The CPU path is the one that takes the oneDNN packed weights and the kept gathers.
    assert platform.use_prepacked_linear(cpu) is torch.backends.mkldnn.is_available()
    assert platform.persistent_decode_gather(cpu) is True
    assert platform.use_panel_linear(cuda, torch.bfloat16) is False
    # bf16 panels only where the kernels' build and the CPU have AMX.
    from actors.layers import kernels

    bf16_panels = kernels.available() and torch.ops.serve_app.panel_linear_bf16()
    assert platform.use_panel_linear(cpu, torch.bfloat16) is bf16_panels
    assert platform.use_panel_linear(cpu, torch.float16) is False


def test_the_cpu_kernels_can_be_switched_off(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SERVE_APP_CPU_PREPACK", "0")
    monkeypatch.setenv("SERVE_APP_DECODE_GATHER_REUSE", "0")
    monkeypatch.setenv("SERVE_APP_CPU_PANEL_LINEAR", "0")
    assert platform.use_prepacked_linear(torch.device("cpu")) is False
    assert platform.use_panel_linear(torch.device("cpu"), torch.float32) is False
    assert platform.use_panel_linear(torch.device("cpu"), torch.bfloat16) is False
    assert platform.persistent_decode_gather(torch.device("cpu")) is False


def test_cuda_defaults_to_bf16_and_nccl(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert platform.default_dtype() is torch.bfloat16
    assert platform.resolve_dtype("auto") is torch.bfloat16
    assert platform.distributed_backend() == "nccl"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert platform.default_dtype() is torch.float32
    assert platform.distributed_backend() == "gloo"


def test_kv_blocks_default_to_128_tokens_on_cpu_and_16_on_cuda(monkeypatch: pytest.MonkeyPatch):
    from actors.config import CacheConfig, ParallelConfig
    from actors.executor import ranks_on_gpu

    assert CacheConfig().settled(on_gpu=False).block_size == 128
    assert CacheConfig().settled(on_gpu=True).block_size == 16
    # An operator's block size stands on either.
    assert CacheConfig(block_size=32).settled(on_gpu=False).block_size == 32
    assert CacheConfig(block_size=32).settled(on_gpu=True).block_size == 32
    # At TP=1 the ranks run where this process does; above, where their bundles ask.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ranks_on_gpu(ParallelConfig()) is True
    assert ranks_on_gpu(ParallelConfig(tensor_parallel_size=2, use_gpu=False)) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ranks_on_gpu(ParallelConfig()) is False
    assert ranks_on_gpu(ParallelConfig(tensor_parallel_size=2, use_gpu=True)) is True


def test_a_cpu_engine_with_no_block_size_pages_its_cache_in_128_token_blocks(model_dirs):
    from actors import LLM, SamplingParams

    with LLM(model=str(model_dirs("llama")), num_kv_blocks=8) as llm:
        core = llm.engine
        assert core.cache_config.block_size == core.block_manager.block_size == 128
        k_cache, v_cache = core.executor.worker.runner.kv_caches[0]
        assert k_cache.shape[2] == v_cache.shape[2] == 128  # (kv_heads, blocks, 128, head_dim)
        out = llm.generate([list(range(10, 140))], SamplingParams(max_tokens=2, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 2
        assert llm.stats()["kv_blocks_used"] == 0
