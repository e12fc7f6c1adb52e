"""Runs generation resources outside the HTTP request that created them.

Each generation runs in its own task owned by the process, not the request
(`serve_app.resources.owned`): a disconnect never cancels it. Handlers only wait on futures.

One task per generation: insert (atomically with its Idempotency-Key and conversation
turn) -> running -> grammar + engine stream -> settle -> save -> tell the waiters. The
record is saved before any waiter hears the end, so a terminal event is never ahead of
the store.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from typing import Any

from actors.messages import EngineRequest
from serve_app.config.profiles import GenerationOptions
from serve_app.metrics import record_latency, record_outcome, record_tokens
from serve_app.resources.admitted import AdmittedGeneration
from serve_app.resources.owned import OwnedTasks
from serve_app.resources.resource import (
    UNFINISHED,
    Outcome,
    failed,
    settle,
    usage,
)
from serve_app.resources.running import Event, RunningGeneration
from serve_app.store.base import GenerationRecord, InsertOutcome, InsertResult, Store, TurnAppend

logger = logging.getLogger(__name__)

# Beyond the engine's own deadline: how long to wait for an engine that went silent.
ENGINE_SILENCE_GRACE_S = 10.0
# How often a running generation checks the store for a cancel written by another process.
STORE_WATCH_PERIOD_S = 2.0


@dataclass
class Progress:
    text: str = ""
    num_tokens: int = 0
    num_cached_tokens: int = 0
    finish: str | None = None
    error: tuple[str, str] | None = None  # (code, message)


class GenerationRunner:
    def __init__(
        self,
        store: Store,
        engine: Any,  # engine handle with .options(stream=True)
        grammar: Any,  # grammar handle
        options: GenerationOptions,
        owner: str,
        render: Any,  # GenerationRecord -> resource JSON
    ) -> None:
        self.store = store
        self.engine = engine
        self.grammar = grammar
        self.options = options
        self.owner = owner
        self.render = render
        self.live: dict[str, RunningGeneration] = {}
        self.watch_period_s = STORE_WATCH_PERIOD_S
        self.tasks = OwnedTasks()

    # ------------------------------------------------------------------ requests

    async def submit(
        self, plan: AdmittedGeneration, *, subscribe: bool
    ) -> tuple[InsertResult, RunningGeneration]:
        """Record the generation and start it; returns once the insert has committed."""
        live = RunningGeneration(plan)
        if subscribe:
            live.subscribe()
        admitted: asyncio.Future[InsertResult] = asyncio.get_running_loop().create_future()
        self.spawn(self._run(live, admitted))
        # shield: a disconnect cancels this wait, never the insert or the run.
        return await asyncio.shield(admitted), live

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.tasks.spawn(coro)

    async def cancel(self, tenant: str, generation_id: str) -> GenerationRecord | None:
        """Idempotent: the current state after the request; completion may win the race."""
        live = self.live.get(generation_id)
        if live is not None and live.plan.record.tenant == tenant:
            live.request_cancel()
            return await asyncio.shield(live.done)
        record = await asyncio.to_thread(self.store.get_generation, tenant, generation_id)
        if record is None or record.is_terminal:
            return record
        # Owned by another process: end it in the store; the owner's own save then loses.
        outcome = settle(None, "", record.data.get("output_format", "text"), None, cancelled=True)
        cancelled = self._terminal(record, outcome, unmeasured(record))
        if await asyncio.to_thread(self.store.finish_generation, cancelled, UNFINISHED):
            return cancelled
        return await asyncio.to_thread(self.store.get_generation, tenant, generation_id)

    # ------------------------------------------------------------------- one run

    async def _run(self, live: RunningGeneration, admitted: asyncio.Future[InsertResult]) -> None:
        plan = live.plan
        try:
            result = await asyncio.to_thread(
                self.store.insert_generation, plan.record, plan.idempotency, plan.turn
            )
        except BaseException as exc:
            plan.end(0)
            admitted.set_exception(exc)
            return
        if result.outcome is not InsertOutcome.CREATED:
            plan.end(0)  # nothing new was generated
            admitted.set_result(result)
            return
        self.live[plan.record.id] = live
        admitted.set_result(result)
        try:
            final = await self._execute(live)
        except Exception:
            logger.exception("generation %s failed in the runner", plan.record.id)
            final = await self._save(live, failed("internal_error", "internal error"), Progress())
        finally:
            self.live.pop(plan.record.id, None)
        tokens = final.data.get("usage", {})
        num_input, num_output = tokens.get("input_tokens", 0), tokens.get("output_tokens") or 0
        plan.end(num_input + num_output)
        live.finish(final, self.render(final))
        observe_end(final, time.time() - plan.record.created_at)

    async def _execute(self, live: RunningGeneration) -> GenerationRecord:
        plan = live.plan
        now = time.time()
        record = plan.record
        running = replace(
            record,
            status="running",
            data={**record.data, "started_at": now},
            updated_at=now,
        )
        if not await asyncio.to_thread(self.store.update_generation, running, {"queued"}):
            return await self._current(record)  # ended elsewhere before it started
        plan.record = running
        progress = Progress()
        if not live.is_cancel_requested:
            watcher = asyncio.get_running_loop().create_task(self._watch_store(live))
            try:
                await self._generate(live, progress)
            finally:
                watcher.cancel()
        return await self._save(live, self._outcome(live, progress), progress)

    async def _watch_store(self, live: RunningGeneration) -> None:
        """Stop the work once its record ended elsewhere (a cancel that reached another
        ingress replica, which can only write the store)."""
        record = live.plan.record
        while True:
            await asyncio.sleep(self.watch_period_s)
            stored = await asyncio.to_thread(self.store.get_generation, record.tenant, record.id)
            if stored is None or stored.is_terminal:
                live.request_cancel()
                return

    async def _generate(self, live: RunningGeneration, progress: Progress) -> None:
        plan = live.plan
        box = None
        if plan.grammar is not None:
            ref = await self.grammar.compile.remote(plan.grammar)._to_object_ref()
            box = [ref]  # boxed: prefill overlaps compilation
        timeout_s = max(plan.deadline - time.time(), 0.001)
        request = EngineRequest(
            plan.record.id,
            plan.prompt_ids,
            plan.params,
            grammar=box,
            timeout_s=timeout_s,
            cache_namespace=plan.cache_namespace,
        )
        live.stream = stream = self.engine.generate.remote(request)
        if live.is_cancel_requested:
            stream.cancel()
        try:
            while True:
                wait_s = plan.deadline - time.time() + ENGINE_SILENCE_GRACE_S
                out = await asyncio.wait_for(stream.__anext__(), max(wait_s, 0.001))
                if self._absorb(live, progress, out):
                    return
        except StopAsyncIteration:
            return
        except TimeoutError:
            stream.cancel()
            progress.error = ("engine_lost", "the engine went silent past the deadline")
        except (Exception, asyncio.CancelledError) as exc:
            if live.is_cancel_requested and not _runner_cancelled():
                return
            if isinstance(exc, asyncio.CancelledError):
                raise
            logger.error("engine stream of %s failed: %s", plan.record.id, type(exc).__name__)
            progress.error = ("engine_lost", f"the engine was lost ({type(exc).__name__})")

    def _absorb(self, live: RunningGeneration, progress: Progress, out: Any) -> bool:
        """Take one engine output; True when the generation has ended."""
        if out.error is not None:
            progress.error = (out.error_code or "engine_error", out.error)
            return True
        progress.num_cached_tokens = out.num_cached_tokens
        for delta in out.deltas:
            progress.text += delta.text
            progress.num_tokens += len(delta.token_ids)
            if delta.finish_reason is not None:
                progress.finish = delta.finish_reason.value
            if delta.text and live.plan.output_format == "text":
                live.publish(self._delta_event(live, progress, delta.text))
        return bool(out.finished)

    def _delta_event(self, live: RunningGeneration, progress: Progress, text: str) -> Event:
        plan = live.plan
        tokens = usage(len(plan.prompt_ids), progress.num_tokens, 0, "provisional")
        return Event(
            "delta",
            {
                "generation_id": plan.record.id,
                "index": 0,
                "delta": {"type": "text", "text": text},
                "usage": tokens,
            },
        )

    def _outcome(self, live: RunningGeneration, progress: Progress) -> Outcome:
        if progress.error is not None:
            return failed(*progress.error)
        # Completion wins the race: a cancel that arrives after the last token changes nothing.
        cancelled = live.is_cancel_requested and progress.finish in (None, "abort")
        return settle(
            progress.finish,
            progress.text,
            live.plan.output_format,
            live.plan.schema,
            cancelled=cancelled,
        )

    async def _save(
        self, live: RunningGeneration, outcome: Outcome, progress: Progress
    ) -> GenerationRecord:
        plan = live.plan
        tokens = usage(
            len(plan.prompt_ids), progress.num_tokens, progress.num_cached_tokens, "final"
        )
        final = self._terminal(plan.record, outcome, tokens)
        append = None
        if plan.turn is not None and outcome.reply_text is not None:
            reply = {"role": "assistant", "content": outcome.reply_text}
            append = TurnAppend([*plan.turn_messages, reply], final.updated_at + self.retention)
        if await asyncio.to_thread(self.store.finish_generation, final, UNFINISHED, append):
            return final
        return await self._current(final)

    @property
    def retention(self) -> float:
        return self.options.retention_s

    def _terminal(
        self, record: GenerationRecord, outcome: Outcome, tokens: dict[str, Any]
    ) -> GenerationRecord:
        now = time.time()
        data = {
            **record.data,
            "output": outcome.output,
            "finish_reason": outcome.finish_reason,
            "usage": tokens,
            "error": outcome.error,
            "finished_at": now,
        }
        return replace(
            record,
            status=outcome.status,
            data=data,
            updated_at=now,
            expires_at=now + self.retention,
        )

    async def _current(self, record: GenerationRecord) -> GenerationRecord:
        stored = await asyncio.to_thread(self.store.get_generation, record.tenant, record.id)
        return stored if stored is not None else record

    # ------------------------------------------------------------------- upkeep

    def sweep_orphans(self) -> int:
        """Fail generations whose process is gone (synchronous: run at startup, then from
        the upkeep loop). Nothing half-done is re-run."""
        self.store.heartbeat(self.owner)
        orphans = self.store.list_orphaned_generations(self.options.orphan_after_s)
        lost = failed("engine_lost", "the server process running this generation was lost")
        for record in orphans:
            self.store.finish_generation(
                self._terminal(record, lost, unmeasured(record)), UNFINISHED
            )
        if orphans:
            logger.warning("marked %d orphaned generation(s) failed (engine_lost)", len(orphans))
        return len(orphans)

    async def upkeep_forever(self) -> None:
        """Heartbeat, sweep orphans and purge expired rows, until the process ends."""
        period = self.options.orphan_after_s / 4
        last_purge = 0.0
        while True:
            try:
                await asyncio.to_thread(self.sweep_orphans)
                if time.monotonic() - last_purge > self.options.purge_interval_s:
                    last_purge = time.monotonic()
                    await asyncio.to_thread(self.store.purge_expired)
            except Exception:
                logger.exception("generation store upkeep failed")
            await asyncio.sleep(period)


def unmeasured(record: GenerationRecord) -> dict[str, Any]:
    """Usage of a generation ended by a process that did not run it: the output it made is
    unknown here, which is said (null, an estimate), not recorded as zero."""
    return {**record.data.get("usage", {}), "output_tokens": None, "kind": "estimate"}


def observe_end(record: GenerationRecord, seconds: float) -> None:
    """Metrics of a finished generation (never its text)."""
    tokens = record.data.get("usage", {})
    error = record.data.get("error") or {}
    record_outcome(
        "generations", record.data.get("finish_reason") or "unknown", error.get("code", "")
    )
    record_latency("e2e", seconds, "generations")
    record_tokens(
        "generations",
        tokens.get("input_tokens", 0),
        tokens.get("output_tokens") or 0,
        tokens.get("cached_input_tokens", 0),
    )


def _runner_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
