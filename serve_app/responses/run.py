"""One response's run: engine outputs in, the typed stream events out, in their order, the
final response object last. Both modes read it: the SSE writer sends each event as it comes,
a JSON answer keeps only the final object. The stored record is written before the terminal
event leaves, so a response a client saw end is always retrievable.

Order: `response.created`, `response.in_progress`, then per output item `output_item.added`
(+ `content_part.added`), its deltas, its `.done` events, and last one of
`response.completed` / `response.incomplete` / `response.failed`. Nothing follows it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from actors.outputs import RequestOutput
from serve_app import outcomes
from serve_app.access.budgets import record_usage
from serve_app.metrics import record_latency, record_outcome, record_tokens
from serve_app.parsers.chat_output import ChoiceParser, OutputEvent
from serve_app.responses.admission import AdmittedResponse
from serve_app.responses.output import Event, OutputItems, usage

logger = logging.getLogger(__name__)

ENDPOINT = "responses"


@dataclass(frozen=True)
class Ending:
    """How the response ended, in the Responses API's words (the outcome table's column)."""

    status: str  # completed | incomplete | failed | cancelled
    incomplete_reason: str | None = None
    error: dict[str, str] | None = None


def ending_of(finish_reason: str, stop_reason: Any) -> Ending:
    """The outcome table's responses column (`serve_app.outcomes`): an abort the reader did
    not cause, or any ending it does not name, is the engine's failure."""
    status, detail = outcomes.response_end(finish_reason, stop_reason)
    if status == "cancelled":  # an abort nobody asked for (a cancel is the run's to say)
        status, detail = outcomes.response_end("error")
    if status == "incomplete":
        return Ending("incomplete", detail)
    if status == "failed":
        code = detail or "engine_lost"
        return Ending("failed", error={"code": code, "message": f"the response ended ({code})"})
    return Ending(status)


class ResponseRun:
    def __init__(
        self,
        admitted: AdmittedResponse,
        base: Callable[..., dict[str, Any]],
        save: Callable[[AdmittedResponse, dict[str, Any]], Awaitable[dict[str, Any] | None]],
        is_cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        self.admitted = admitted
        self.base = base  # (status, output, usage, ...) -> the response object
        # Returns the stored object when the store already holds another ending (a cancel
        # another replica wrote first), None to keep this run's.
        self.save = save
        self.is_cancelled = is_cancelled  # a cancel was asked for (POST .../cancel)
        self.items = OutputItems()
        self.parser = ChoiceParser(admitted.parse)
        self.num_output_tokens = 0
        self.num_reasoning_tokens = 0
        self.num_cached_tokens = 0
        self.final: dict[str, Any] | None = None

    def usage(self) -> dict[str, Any]:
        return usage(
            self.admitted.num_prompt_tokens,
            self.num_output_tokens,
            self.num_cached_tokens,
            self.num_reasoning_tokens,
        )

    async def events(
        self, first: RequestOutput, outputs: AsyncIterator[Any], *, created: bool = True
    ) -> AsyncIterator[Event]:
        """Every stream event of the response, the terminal one last (without
        `response.created` when `created` is False: a background response announced it)."""
        if created:
            yield {"type": "response.created", "response": self.base("in_progress", [], None)}
        yield {"type": "response.in_progress", "response": self.base("in_progress", [], None)}
        ending: Ending | None = None
        out: RequestOutput | None = first
        first_event: float | None = None
        try:
            while True:
                if out is not None:
                    events, ending = self._absorb(out)
                    if events and first_event is None:
                        first_event = time.monotonic()
                        record_latency("ttft", first_event - self.admitted.started, ENDPOINT)
                    for event in events:
                        yield event
                    if ending is not None or out.finished:
                        break
                try:
                    out = await self._next(outputs)
                except _Lost as exc:
                    ending = Ending("failed", error={"code": "engine_lost", "message": str(exc)})
                    break
            if self.is_cancelled() and (ending is None or ending.status == "failed"):
                # The engine stream ended because it was cancelled; a finished one stays.
                ending = Ending("cancelled")
        except asyncio.CancelledError:
            # The client left: nothing is stored (the stream is closed), usage is settled.
            record_usage(self.admitted.num_prompt_tokens + self.num_output_tokens)
            record_outcome(ENDPOINT, "cancelled", "client_disconnect")
            raise
        if ending is None:
            ending = Ending(
                "failed",
                error={"code": "engine_lost", "message": "the engine stream ended early"},
            )
        for event in self._close(ending):
            yield event
        final = self.base(
            ending.status,
            self.items.items,
            self.usage(),
            error=ending.error,
            incomplete_reason=ending.incomplete_reason,
        )
        final = await self.save(self.admitted, final) or final
        self.final = final
        self._observe(ending)
        yield {"type": f"response.{final['status']}", "response": final}

    async def _next(self, outputs: AsyncIterator[Any]) -> RequestOutput | None:
        deadline = self.admitted.deadline
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.001)
        try:
            return await asyncio.wait_for(outputs.__anext__(), timeout)
        except StopAsyncIteration:
            raise _Lost("the engine stream ended before the response finished") from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.is_cancelled() and (task is None or task.cancelling() == 0):
                raise _Lost("cancelled") from None  # the engine stream a cancel stopped
            raise
        except TimeoutError:
            raise _Lost("the engine went silent past the deadline") from None
        except Exception as exc:  # the replica or a worker of it died under the call
            logger.error("engine stream of %s lost: %s", self.admitted.response_id, exc)
            raise _Lost(f"the engine was lost ({type(exc).__name__})") from None

    def _absorb(self, out: RequestOutput) -> tuple[list[Event], Ending | None]:
        if out.error is not None:
            code = out.error_code or "engine_error"
            return [], Ending("failed", error={"code": code, "message": out.error})
        self.num_cached_tokens = out.num_cached_tokens
        events: list[Event] = []
        ending = None
        for delta in out.deltas:
            num = len(delta.token_ids)
            self.num_output_tokens += num
            was_reasoning = self._in_reasoning()
            parsed: list[OutputEvent] = self.parser.feed(delta.text) if delta.text else []
            if was_reasoning or self._in_reasoning():
                # Tokens written inside the `<think>` span, its tags included.
                self.num_reasoning_tokens += num
            if delta.finish_reason is not None:
                parsed += self.parser.finish()
                ending = ending_of(delta.finish_reason.value, delta.stop_reason)
            for event in parsed:
                events += self.items.add(event)
        return events, ending

    def _in_reasoning(self) -> bool:
        reasoning = self.parser.reasoning
        return reasoning is not None and reasoning.in_reasoning

    def _close(self, ending: Ending) -> list[Event]:
        self.items.mark_broken(self.parser.broken_call_indices)
        return self.items.close("completed" if ending.status == "completed" else "incomplete")

    def _observe(self, ending: Ending) -> None:
        code = (ending.error or {}).get("code", "") or (ending.incomplete_reason or "")
        record_outcome(ENDPOINT, ending.status, code)
        record_latency("e2e", time.monotonic() - self.admitted.started, ENDPOINT)
        record_tokens(
            ENDPOINT,
            self.admitted.num_prompt_tokens,
            self.num_output_tokens,
            self.num_cached_tokens,
        )
        record_usage(self.admitted.num_prompt_tokens + self.num_output_tokens)


class _Lost(Exception):
    """The engine call ended or went silent before the response's last output."""
