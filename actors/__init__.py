"""The engine: continuous batching over a paged KV cache for Llama-family checkpoints.

The names below load on first use (PEP 562): importing `actors` or one of its plain modules
(`actors.sampling_params`, `actors.messages`) does not import torch, so the ingress and the
proxy, which only build requests, never pay for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "actors.llm",
    "LLMClosedError": "actors.llm",
    "CompletionOutput": "actors.outputs",
    "GenerationResult": "actors.outputs",
    "SamplingParams": "actors.sampling_params",
}

if TYPE_CHECKING:
    from actors.llm import LLM, LLMClosedError
    from actors.outputs import CompletionOutput, GenerationResult
    from actors.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["LLM", "LLMClosedError", "CompletionOutput", "GenerationResult", "SamplingParams"]
