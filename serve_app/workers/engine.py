"""Engine deployment: one replica = one model copy (its TP workers in the replica's
placement group), a step thread, and typed output streams back to the ingress."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator

from actors.async_engine import AsyncEngine
from actors.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from actors.deadlines import DeadlineConfig
from actors.engine_core import EngineCore
from actors.grammar_cache import CompiledGrammarCache, load_tokenizer_info
from actors.messages import EngineRequest
from actors.outputs import RequestOutput
from actors.platform import describe, resolve_dtype
from actors.tokenizer_file import load_backend_tokenizer
from actors.torch_thread import favour_step_thread
from serve_app.backpressure.stalled_streams import StallWatcher
from serve_app.config.options import ServeConfig
from serve_app.metrics import record_engine_gauges, record_latency, record_speculation
from serve_app.ops.stats import StatsReporter
from serve_app.ops.timelines import TimelineRing
from serve_app.workers.output_channel import (
    Batch,
    ChannelClosed,
    ChannelHello,
    ChannelHub,
    Routed,
    lost_output,
)

logger = logging.getLogger(__name__)


def build_model_config(config: ServeConfig) -> ModelConfig:
    e = config.engine
    return ModelConfig.from_pretrained(
        config.model, dtype=resolve_dtype(e.dtype), max_model_len=e.max_model_len
    )


class EngineService:
    def __init__(self, config: ServeConfig):
        import torch

        e = config.engine
        # Ray pins actors to one OpenMP thread per requested CPU; the engine uses them all.
        torch.set_num_threads(max(1, int(e.replica_cpus)))
        favour_step_thread()
        self.model_config = build_model_config(config)
        tokenizer = load_backend_tokenizer(config.model)

        def build_core() -> EngineCore:
            core = EngineCore(
                self.model_config,
                tokenizer,
                CacheConfig(
                    block_size=e.block_size,
                    memory_budget_bytes=e.kv_cache_bytes,
                    enable_prefix_caching=e.enable_prefix_caching,
                ),
                ParallelConfig(e.tensor_parallel_size, e.placement_strategy, e.placement_timeout_s),
                SchedulerConfig(e.max_num_seqs, e.max_num_batched_tokens),
                seed=e.seed,
                deadline_config=DeadlineConfig(e.default_timeout_s, e.max_queue_s),
                speculative_config=e.speculative_config,
                step_delay_s=e.step_delay_s,
            )
            core.on_queue_time = lambda seconds: record_latency("queue", seconds, "engine")
            if core.proposer is not None:
                core.on_draft_verified = record_speculation
            return core

        # Built lazily on the first grammar: engines that never see one never pay for it.
        grammar_cache = CompiledGrammarCache(lambda: load_tokenizer_info(config.model))
        # The core is built on the engine's step thread (see AsyncEngine._main).
        self.engine = AsyncEngine(
            build_core,
            grammar_cache.get_constraint,
            e.output_queue_size,
            e.hold_timeout_s,
        )
        self.flow = StallWatcher(config.model_id, self.engine.pause_reader)
        self.replica_id = _replica_id()
        self._node_id: str | None = None
        self.channels = ChannelHub(self.replica_id, e.output_queue_size)
        self.timelines = TimelineRing(self.replica_id)
        self.reporter = StatsReporter(
            config.model_id,
            self.replica_id,
            self.stats,
            timelines_fn=self.timelines.take_new,
            on_report=lambda stats: record_engine_gauges(self.replica_id, stats),
        )
        logger.info(
            "engine replica ready on %s (tp=%d, %d KV blocks)",
            describe(),
            e.tensor_parallel_size,
            self.engine.core.block_manager.num_blocks,
        )

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput | Routed]:
        grammar = request.grammar[0] if request.grammar else None
        outputs = self.engine.generate(
            request.request_id,
            request.prompt_token_ids,
            request.params,
            grammar=grammar,
            priority=request.priority,
            timeout_s=request.timeout_s,
            attempt=request.attempt,
            cache_namespace=request.cache_namespace,
        )
        key = request.flow_key
        # Tracked from the first output on: the engine knows the request by then.
        tracked = False
        # Asked for a channel: the first output says whether this replica has it open; if
        # so, every later output goes into it (serve_app/workers/output_channel.py).
        box = self.channels.attach(request.channel)
        try:
            first = True
            async for out in self.timelines.watch(request, outputs):
                if key is not None and not tracked and not out.finished:
                    self.flow.track(key, request.request_id)
                    tracked = True
                if first and request.channel is not None:
                    yield Routed(self.replica_id, box.instance if box is not None else None, out)
                elif box is None:  # unchannelled (a request naming no channel has no box)
                    yield out
                else:
                    await self.channels.push(box, request.request_id, out)
                first = False
        except ChannelClosed:
            yield lost_output("the output channel was closed")
        finally:
            if box is not None:
                self.channels.detach(box)
            if tracked:
                self.flow.untrack(key, request.request_id)

    async def channel(self, channel_id: str) -> AsyncIterator[ChannelHello | Batch]:
        """An ingress replica's output channel to this replica (streamed; ends when idle)."""
        async for item in self.channels.serve(channel_id):
            yield item

    def request_timelines(self, request_id: str) -> list[dict[str, object]]:
        """This replica's recent engine timelines of a request (X-Request-Id or engine id)."""
        return self.timelines.lookup(request_id)

    def stats(self) -> dict[str, object]:
        if self._node_id is None:
            import ray

            self._node_id = ray.get_runtime_context().get_node_id()
        return {
            **self.engine.stats(),
            **self.channels.stats(),
            "replica": self.replica_id,
            "node_id": self._node_id,
        }

    def check_health(self) -> None:
        """Serve calls this periodically; raising makes it replace the replica."""
        if not self.engine.is_healthy():
            raise RuntimeError(f"engine unhealthy: {self.engine.core.dead or 'step thread died'}")

    def __del__(self) -> None:
        reporter = getattr(self, "reporter", None)
        if reporter is not None:
            reporter.stop()
        flow = getattr(self, "flow", None)
        if flow is not None:
            flow.stop()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 (outside Serve: one local engine)
        return f"local-{os.getpid()}"
