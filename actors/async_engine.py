"""EngineCore driven by its own step thread, with one asyncio stream per request.

The event loop never runs engine code: it sends commands (add, abort, set constraints) to
the step thread, and the step thread hands each request's outputs back to the loop. Only the
step thread touches the EngineCore.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from actors.deadlines import RequestRejected
from actors.engine_core import EngineCore
from actors.executor import ExecutorError
from actors.output_stream import OutputStream, Phase
from actors.outputs import RequestOutput
from actors.request import FinishReason
from actors.sampling_params import SamplingParams
from actors.torch_thread import ENGINE_THREAD_PREFIX, name_os_thread, normal_scheduling

logger = logging.getLogger(__name__)
# How often an engine with live requests but nothing to run re-checks its deadlines.
_IDLE_POLL_S = 0.01
# After posting a step's outputs the step thread waits, at most this long, while the event
# loop delivers them and runs the callbacks the delivery woke (an output channel's send):
# `PUBLISH_PASSES` passes of the loop. Posted and left, the outputs waited for the GIL until
# the next step's first torch op let it go, and the loop then held it between that step's
# ops while both of its OpenMP threads waited. Measured on 2 cores (`bench`, direct ingress,
# `docs/benchmarks.md`): client ITL p50 at 1 / 4 streams 3.56 / 4.16 ms against 4.12 / 5.09,
# TTFT p50 lower at every level, tokens/s within the runs' spread.
PUBLISH_WAIT_S = 0.001
PUBLISH_PASSES = 2

Command = Callable[[EngineCore], None]


class AsyncEngine:
    def __init__(
        self,
        core: EngineCore | Callable[[], EngineCore],
        constraint_builder: Callable[[object], object] | None,
        output_queue_size: int = 64,
        hold_timeout_s: float = 30.0,
    ):
        self.constraint_builder = constraint_builder
        self.output_queue_size = output_queue_size
        self.hold_timeout_s = hold_timeout_s
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        # Keyed by the core's id of one attempt; an entry lives until the engine is done
        # with the attempt (finished, or its abort confirmed).
        self._streams: dict[str, OutputStream] = {}
        self._live_attempts: dict[str, str] = {}
        # The window, counted on both sides (one writer each): outputs the step thread posted
        # for an attempt, and outputs its consumer took. The step thread holds an attempt as
        # soon as `capacity` are unread, however far the event loop lags behind it.
        self._posted: dict[str, int] = {}
        self._taken: dict[str, int] = {}
        # Attempts the step thread holds for a full window (or was told to hold): read and
        # written on the step thread only.
        self._held_on_step: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False
        self.num_fenced_outputs = 0
        # Fenced outputs of steps that began after their consumer left: the engine's own
        # lag in honouring a cancel. (The rest were computed before it and still queued to
        # the event loop when it came.)
        self.num_outputs_after_cancel = 0
        self.num_slow_consumer_cancels = 0
        # Steps begun by the step thread; outputs are posted with the number of their step.
        self._steps_begun = 0
        # Set on the event loop once it has delivered the latest step's posted outputs.
        self._published = threading.Event()
        self._booted = threading.Event()
        self._boot_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._main, args=(core,), name="engine-step", daemon=True
        )
        self._thread.start()
        self._booted.wait()
        if self._boot_error is not None:
            raise self._boot_error

    # -------------------------------------------------------------- event-loop side
    def _submit(self, command: Command) -> None:
        self._commands.put(command)
        self._wake.set()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        grammar: Awaitable[object] | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
        attempt: int = 0,
        cache_namespace: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """Stream one attempt's outputs; leaving the iterator early aborts it. Every output
        carries its attempt number; outputs of a closed attempt are never delivered. Cached
        prefix blocks are shared only within `cache_namespace`."""
        if self.core.dead is not None:
            raise ExecutorError(f"engine is not running: {self.core.dead}")
        if request_id in self._live_attempts:
            raise ValueError(f"request_id: {request_id!r} is already running")
        self.core.validate_prompt(prompt_token_ids)  # reads config only: safe off-thread
        self._loop = asyncio.get_running_loop()
        core_id = f"{request_id}@{attempt}"
        stream = OutputStream(request_id, attempt, self.output_queue_size)
        self._streams[core_id] = stream
        self._live_attempts[request_id] = core_id
        add = self._add_command(
            core_id, prompt_token_ids, params, grammar, priority, timeout_s, cache_namespace
        )
        self._submit(add)
        task = None
        if grammar is not None:
            task = asyncio.create_task(self._attach_grammar(core_id, grammar, params.n))
        try:
            while True:
                out, resume = await stream.pop()
                self._taken[core_id] = self._taken.get(core_id, 0) + 1
                if resume:
                    self._resume(core_id, stream)
                yield out
                if out.finished:
                    return
        finally:
            self._live_attempts.pop(request_id, None)
            self._taken.pop(core_id, None)
            if task is not None:
                task.cancel()
            self._cancel_timer(stream)
            if stream.phase is not Phase.FINISHED:
                stream.phase = Phase.CANCELLING
                stream.closed_at_step = self._steps_begun
                self._submit(lambda core: core.abort(core_id))

    def _add_command(
        self,
        core_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        grammar: Awaitable[object] | None,
        priority: int,
        timeout_s: float | None,
        cache_namespace: str = "",
    ) -> Command:
        awaiting = grammar is not None

        def add(core: EngineCore) -> None:
            try:
                core.add_request(
                    core_id,
                    prompt_token_ids,
                    params,
                    priority,
                    awaiting_constraint=awaiting,
                    timeout_s=timeout_s,
                    cache_namespace=cache_namespace,
                )
            except Exception as exc:  # noqa: BLE001 (reported to this request's stream)
                code = exc.code if isinstance(exc, RequestRejected) else "internal_error"
                failed = RequestOutput(core_id, prompt_token_ids, [], 0, True, error=str(exc))
                failed.error_code = code
                self._post([failed], self._steps_begun)

        return add

    # ------------------------------------------------------------- backpressure
    def _hold(self, core_id: str, stream: OutputStream) -> None:
        """The reader paused: stop scheduling it, keep its KV."""
        assert self._loop is not None
        stream.phase = Phase.HELD
        self._submit(lambda core: self._hold_on_step(core, core_id))
        self._start_hold_timer(core_id, stream)

    def _start_hold_timer(self, core_id: str, stream: OutputStream) -> None:
        assert self._loop is not None
        stream.hold_timer = self._loop.call_later(
            self.hold_timeout_s, self._expire_hold, core_id, stream
        )

    def _held_by_step(self, core_id: str) -> None:
        """The step thread held this attempt when its window filled (its consumer
        `capacity` outputs behind, the outputs delivered with this call): the hold runs here
        from now on (its deadline, its resume once the reader drained half)."""
        stream = self._streams.get(core_id)
        if stream is None or stream.phase is not Phase.RUNNING:
            return  # held here already, or finished, or its consumer left
        stream.phase = Phase.HELD
        if stream.can_resume:  # the reader took what filled it meanwhile
            self._resume(core_id, stream)
        else:
            self._start_hold_timer(core_id, stream)

    def pause_reader(self, request_id: str, paused: bool) -> None:
        """The reader's transport stopped (or resumed) taking outputs: hold the request now
        rather than when its window fills, so nothing more is produced for it."""
        core_id = self._live_attempts.get(request_id)
        stream = self._streams.get(core_id) if core_id is not None else None
        if stream is None or not stream.is_open:
            return
        stream.pause_reader(paused)
        if paused and stream.phase in (Phase.QUEUED, Phase.RUNNING):
            self._hold(core_id, stream)
        elif stream.can_resume:
            self._resume(core_id, stream)

    def _resume(self, core_id: str, stream: OutputStream) -> None:
        self._cancel_timer(stream)
        stream.phase = Phase.RUNNING
        self._submit(lambda core: self._resume_on_step(core, core_id))

    def _expire_hold(self, core_id: str, stream: OutputStream) -> None:
        if stream.phase is not Phase.HELD:
            return
        self.num_slow_consumer_cancels += 1
        logger.info("request %s cancelled: slow_consumer", stream.request_id)
        self._submit(
            lambda core: core.abort(core_id, FinishReason.ABORT, stop_reason="slow_consumer")
        )

    @staticmethod
    def _cancel_timer(stream: OutputStream) -> None:
        if stream.hold_timer is not None:
            stream.hold_timer.cancel()
            stream.hold_timer = None

    async def _attach_grammar(self, core_id: str, grammar: Awaitable[object], n: int) -> None:
        try:
            payload = await grammar
            assert self.constraint_builder is not None
            constraints = [self.constraint_builder(payload) for _ in range(n)]
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (any compile failure ends this request)
            reason = getattr(exc, "reason", None) or str(exc)
            code = getattr(exc, "code", None) or "invalid_grammar"
            self._submit(
                lambda core: core.abort(core_id, FinishReason.ERROR, reason, error_code=code)
            )
            return
        self._submit(lambda core: core.set_constraints(core_id, constraints))

    def _deliver(self, outputs: list[RequestOutput], step: int, held: Sequence[str] = ()) -> None:
        for out in outputs:
            core_id = out.request_id
            stream = self._streams.get(core_id)
            if stream is None or not stream.is_open:
                # The fence: the consumer of this attempt is gone; only the end matters.
                if stream is not None and out.finished:
                    stream.phase = Phase.RELEASED
                    del self._streams[core_id]
                elif not out.finished:
                    self.num_fenced_outputs += 1
                    if stream is not None and step > stream.closed_at_step:
                        self.num_outputs_after_cancel += 1
                continue
            out.request_id, out.attempt = stream.request_id, stream.attempt
            stream.push(out)
            if out.finished:
                self._cancel_timer(stream)
                del self._streams[core_id]
        for core_id in held:
            self._held_by_step(core_id)

    # -------------------------------------------------------------- step-thread side
    def _hold_on_step(self, core: EngineCore, core_id: str) -> None:
        self._held_on_step.add(core_id)
        core.hold(core_id)

    def _resume_on_step(self, core: EngineCore, core_id: str) -> None:
        self._held_on_step.discard(core_id)
        core.resume(core_id)

    def _count_window(self, outputs: list[RequestOutput]) -> list[str]:
        """Count each attempt's posted outputs; hold those whose consumer now has `capacity`
        unread, and return them (the event loop learns with these outputs)."""
        held = []
        for out in outputs:
            core_id = out.request_id
            if out.finished:
                self._posted.pop(core_id, None)
                self._held_on_step.discard(core_id)
                continue
            posted = self._posted[core_id] = self._posted.get(core_id, 0) + 1
            unread = posted - self._taken.get(core_id, 0)
            if unread >= self.output_queue_size and core_id not in self._held_on_step:
                self._hold_on_step(self.core, core_id)
                held.append(core_id)
        return held

    def _main(self, core: EngineCore | Callable[[], EngineCore]) -> None:
        # Given a factory, the core (weights, KV cache, the profiling forward) is built on
        # this thread, so every torch op of the process runs on one thread. OpenMP gives each
        # thread that runs torch ops a team of its own; with a second team left idle by a
        # loading thread, steps ran ~20% slower on 2 cores (measured, bench checkpoint).
        # Before the first torch op: the OpenMP team this thread starts inherits the name.
        name_os_thread(ENGINE_THREAD_PREFIX + "step")
        normal_scheduling()  # its OpenMP team inherits the policy too
        try:
            self.core = core if isinstance(core, EngineCore) else core()
        except BaseException as exc:  # noqa: BLE001 (re-raised in the constructor)
            self._boot_error = exc
            return
        finally:
            self._booted.set()
        self._run()

    def _run(self) -> None:
        while not self._stopped:
            self._drain_commands()
            if not self.core.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            self._steps_begun += 1
            ran = self.core.num_steps
            try:
                outputs = self.core.step()
            except Exception:
                logger.exception("engine step raised; failing every live request")
                outputs = self.core.fail_all("internal engine error")
            # Counted before they are posted: the event loop rewrites each output's id.
            held = self._count_window(outputs)
            self._post(outputs, self._steps_begun, held)
            if self.core.num_steps == ran and not outputs:
                # Live requests but nothing to run (all waiting for a grammar, or held): wait
                # for a command instead of spinning, which took a core and the GIL from the
                # event loop that delivers the grammar. The timeout keeps deadlines checked.
                self._wake.wait(timeout=_IDLE_POLL_S)
                self._wake.clear()

    def _post(self, outputs: list[RequestOutput], step: int, held: Sequence[str] = ()) -> None:
        """Hand outputs to the event loop and give it the GIL while it delivers them (at
        most PUBLISH_WAIT_S: a busy or stopped loop never holds the step thread longer)."""
        if outputs and self._loop is not None:
            self._published.clear()
            try:
                self._loop.call_soon_threadsafe(self._deliver_posted, outputs, step, held)
            except RuntimeError:  # the loop has closed: no reader is left to deliver to
                return
            self._published.wait(PUBLISH_WAIT_S)

    def _deliver_posted(self, outputs: list[RequestOutput], step: int, held: Sequence[str]) -> None:
        self._deliver(outputs, step, held)
        self._mark_published(step, PUBLISH_PASSES - 1)

    def _mark_published(self, step: int, passes: int) -> None:
        """Event-loop side: `passes` passes of the loop from now, tell the step thread that
        the outputs of `step` are out (a late mark for an earlier step tells it nothing)."""
        if passes > 0:
            asyncio.get_running_loop().call_soon(self._mark_published, step, passes - 1)
        elif step == self._steps_begun:
            self._published.set()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command(self.core)
            except Exception:
                logger.exception("engine command failed")

    # ------------------------------------------------------------------- lifecycle
    def stats(self) -> dict[str, int]:
        phases = [s.phase for s in self._streams.values()]
        return {
            **self.core.stats(),
            "live_requests": len(self._streams),
            "cancelling": phases.count(Phase.CANCELLING),
            "fenced_outputs": self.num_fenced_outputs,
            "outputs_after_cancel": self.num_outputs_after_cancel,
            "slow_consumer_cancels": self.num_slow_consumer_cancels,
            "unread_outputs": sum(s.unread for s in self._streams.values()),
        }

    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self.core.is_healthy()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)
        self.core.shutdown()
