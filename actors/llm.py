"""The offline facade: `LLM(model=DIR or FILE.gguf).generate(prompts, params)`, vLLM-like.

An `LLM` holds its model and KV cache, and at TP > 1 a placement group and one Ray actor per
rank. `close()` (or leaving a `with LLM(...)` block) releases them; an `LLM` dropped without
either (`del llm`, a notebook cell that rebinds the name) releases its ranks and group
through a finalizer.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence as Seq
from typing import Any

from actors.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    CacheConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from actors.engine_core import EngineCore
from actors.executor import ExecutorError
from actors.outputs import CompletionOutput, GenerationResult
from actors.platform import resolve_dtype
from actors.sampling_params import SamplingParams
from actors.tokenizer_file import load_tokenizer

Prompt = str | list[int]


class LLMClosedError(RuntimeError):
    """The LLM was closed: its model, KV cache and ranks are gone."""


class LLM:
    def __init__(
        self,
        model: str,
        tensor_parallel_size: int = 1,
        dtype: str | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        block_size: int | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_bytes: int = 512 * 1024**2,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        placement_strategy: str = "STRICT_PACK",
        placement_timeout_s: float = 60.0,
        speculative_config: dict[str, Any] | None = None,
        step_delay_s: float = 0.0,
    ):
        from actors.models.gguf import resolve_checkpoint

        # A GGUF file is dequantized once into a cached checkpoint folder (actors/models/gguf.py).
        model = resolve_checkpoint(model)
        self.model_config = ModelConfig.from_pretrained(
            model, dtype=resolve_dtype(dtype), max_model_len=max_model_len
        )
        self.tokenizer = load_tokenizer(model)
        engine = EngineCore(
            self.model_config,
            self.tokenizer.backend_tokenizer,
            CacheConfig(
                block_size=block_size,
                memory_budget_bytes=kv_cache_bytes,
                num_blocks=num_kv_blocks,
                enable_prefix_caching=enable_prefix_caching,
            ),
            ParallelConfig(tensor_parallel_size, placement_strategy, placement_timeout_s),
            SchedulerConfig(max_num_seqs, max_num_batched_tokens),
            seed=seed,
            speculative_config=speculative_config,
            step_delay_s=step_delay_s,
        )
        self._engine: EngineCore | None = engine
        # NOTE: the finalizer keeps only the executor's releaser (rank actors, placement
        # group), never `self` or the engine, so an unreferenced LLM can still be collected.
        self._finalizer = weakref.finalize(self, engine.executor.releaser())
        # At interpreter exit Ray ends the driver's job and takes its groups and actors
        # with it; calling into a Ray that is shutting down would only risk a hang.
        self._finalizer.atexit = False
        self._ids = itertools.count()

    @property
    def engine(self) -> EngineCore:
        if self._engine is None:
            raise LLMClosedError("this LLM is closed; create a new LLM(...) to generate again")
        return self._engine

    @property
    def is_closed(self) -> bool:
        return self._engine is None

    def close(self) -> None:
        """Release the ranks, the placement group, the model and the KV cache; idempotent.
        Any later `generate` raises `LLMClosedError`."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        try:
            engine.shutdown()
        finally:
            self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | dict[str, Any] | Seq[SamplingParams] | None = None,
        priorities: Seq[int] | None = None,
    ) -> list[GenerationResult]:
        """Run all prompts to completion with continuous batching; results in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if isinstance(params, dict):
            params = SamplingParams(**params)
        params_list = (
            list(params)
            if isinstance(params, Seq)
            else [params or SamplingParams()] * len(prompt_list)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError("params: one SamplingParams per prompt, or a single one")
        token_lists = [self._tokenize(p) for p in prompt_list]
        for ids in token_lists:
            self.engine.validate_prompt(ids)
        results: dict[str, GenerationResult] = {}
        order = []
        for i, (ids, p) in enumerate(zip(token_lists, params_list, strict=True)):
            request_id = f"offline-{next(self._ids)}"
            order.append(request_id)
            results[request_id] = GenerationResult(
                request_id, ids, [CompletionOutput(j) for j in range(p.n)]
            )
            priority = priorities[i] if priorities else 0
            self.engine.add_request(request_id, ids, p, priority=priority)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.error is not None:
                    raise ExecutorError(f"generation failed: {out.error}")
                result = results[out.request_id]
                result.num_cached_tokens = out.num_cached_tokens
                if out.prompt_logprobs is not None:
                    result.prompt_logprobs = out.prompt_logprobs
                for delta in out.deltas:
                    result.outputs[delta.index].add(delta)
        return [results[r] for r in order]

    def stats(self) -> dict[str, int]:
        return self.engine.stats()

    def shutdown(self) -> None:
        """The same as `close()` (the name the engine classes use)."""
        self.close()
