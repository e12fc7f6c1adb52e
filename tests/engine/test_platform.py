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
    assert platform.persistent_decode_gather(cuda) is False
    # The CPU path is the one that takes the oneDNN packed weights and the kept gathers.
    assert platform.use_prepacked_linear(cpu) is torch.backends.mkldnn.is_available()
    assert platform.persistent_decode_gather(cpu) is True


def test_the_cpu_kernels_can_be_switched_off(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SERVE_APP_CPU_PREPACK", "0")
    monkeypatch.setenv("SERVE_APP_DECODE_GATHER_REUSE", "0")
    assert platform.use_prepacked_linear(torch.device("cpu")) is False
    assert platform.persistent_decode_gather(torch.device("cpu")) is False


def test_cuda_defaults_to_bf16_and_nccl(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert platform.default_dtype() is torch.bfloat16
    assert platform.resolve_dtype("auto") is torch.bfloat16
    assert platform.distributed_backend() == "nccl"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert platform.default_dtype() is torch.float32
    assert platform.distributed_backend() == "gloo"
