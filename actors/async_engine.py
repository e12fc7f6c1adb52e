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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from actors.deadlines import RequestRejected
from actors.engine_core import EngineCore
from actors.executor import ExecutorError
from actors.outputs import RequestOutput
from actors.request import FinishReason
from actors.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Command = Callable[[EngineCore], None]


@dataclass
class _Stream:
    queue: asyncio.Queue[RequestOutput] = field(default_factory=asyncio.Queue)
    finished: bool = False


class AsyncEngine:
    def __init__(self, core: EngineCore, constraint_builder: Callable[[object], object] | None):
        self.core = core
        self.constraint_builder = constraint_builder
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._thread.start()

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
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving the iterator early aborts the request."""
        if self.core.dead is not None:
            raise ExecutorError(f"engine is not running: {self.core.dead}")
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already running")
        self.core.validate_prompt(prompt_token_ids)  # reads config only: safe off-thread
        self._loop = asyncio.get_running_loop()
        stream = _Stream()
        self._streams[request_id] = stream
        awaiting = grammar is not None

        def add(core: EngineCore) -> None:
            try:
                core.add_request(
                    request_id,
                    prompt_token_ids,
                    params,
                    priority,
                    awaiting_constraint=awaiting,
                    timeout_s=timeout_s,
                )
            except Exception as exc:  # noqa: BLE001 (reported to this request's stream)
                code = exc.code if isinstance(exc, RequestRejected) else "internal_error"
                failed = RequestOutput(request_id, prompt_token_ids, [], 0, True, error=str(exc))
                failed.error_code = code
                self._post([failed])

        self._submit(add)
        task = None
        if grammar is not None:
            task = asyncio.create_task(self._attach_grammar(request_id, grammar, params.n))
        try:
            while True:
                out = await stream.queue.get()
                if out.finished:
                    stream.finished = True
                yield out
                if out.finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if task is not None:
                task.cancel()
            if not stream.finished:
                self._submit(lambda core: core.abort(request_id))

    async def _attach_grammar(self, request_id: str, grammar: Awaitable[object], n: int) -> None:
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
                lambda core: core.abort(request_id, FinishReason.ERROR, reason, error_code=code)
            )
            return
        self._submit(lambda core: core.set_constraints(request_id, constraints))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.queue.put_nowait(out)

    # -------------------------------------------------------------- step-thread side
    def _run(self) -> None:
        while not self._stopped:
            self._drain_commands()
            if not self.core.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.core.step()
            except Exception:
                logger.exception("engine step raised; failing every live request")
                outputs = self.core.fail_all("internal engine error")
            self._post(outputs)

    def _post(self, outputs: list[RequestOutput]) -> None:
        if outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

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
        return {**self.core.stats(), "live_requests": len(self._streams)}

    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self.core.is_healthy()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)
        self.core.shutdown()
