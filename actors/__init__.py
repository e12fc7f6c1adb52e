"""The engine: continuous batching over a paged KV cache for Llama-family checkpoints."""

from actors.llm import LLM, LLMClosedError
from actors.outputs import CompletionOutput, GenerationResult
from actors.sampling_params import SamplingParams

__all__ = ["LLM", "LLMClosedError", "CompletionOutput", "GenerationResult", "SamplingParams"]
