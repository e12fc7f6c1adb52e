"""The OpenAI stream writer: engine outputs in, SSE frames out, in the promised order
(`serve_app.openai.streaming`), plus the end-of-request metrics both response modes record.

Outputs are read as what is ready at each pull (`Ready`): while the writer keeps up that is
one engine output, so one token per event; when it fell behind, a choice's pending deltas
leave as one event (seed 000: fragmentation changes chunking, never meaning). Nothing waits
to gather more."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from actors.outputs import CompletionDelta
from serve_app import errors
from serve_app.access.budgets import measure_usage, record_usage
from serve_app.metrics import (
    record_latency,
    record_outcome,
    record_tokens,
    record_tokens_per_chunk,
)
from serve_app.openai.admission import AdmittedRequest
from serve_app.openai.format import ChoiceState, Formatter
from serve_app.openai.streaming import StreamState
from serve_app.parsers.chat_output import OutputEvent, ReasoningDelta
from serve_app.parsers.tools import ContentDelta, ToolCallArgsDelta
from serve_app.protocol import Usage
from serve_app.workers.merged_outputs import Merged

logger = logging.getLogger(__name__)


def observe_end(job: AdmittedRequest, choices: list[ChoiceState], usage: Usage) -> None:
    record_latency("e2e", time.monotonic() - job.started, job.endpoint)
    for c in choices:
        # A slow consumer's abort is counted apart from a client's own cancel, and a grammar's
        # own end apart from other stops (and from invalid_grammar, an error).
        code = c.stop_reason if c.stop_reason in ("slow_consumer", "grammar_end") else ""
        record_outcome(job.endpoint, c.finish_reason or "unknown", code)
    logger.info(
        "request finished: endpoint=%s outcomes=%s prompt_tokens=%d output_tokens=%d",
        job.endpoint,
        ",".join(c.finish_reason or "unknown" for c in choices),
        usage.prompt_tokens,
        usage.completion_tokens,
    )
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    record_tokens(job.endpoint, usage.prompt_tokens, usage.completion_tokens, cached)
    record_usage(usage.total_tokens)


def record_cancel(job: AdmittedRequest) -> None:
    """The client went away (Serve cancelled the handler): not an error, not a timeout."""
    record_outcome(job.endpoint, "cancelled", "client_disconnect")
    logger.info("request cancelled: endpoint=%s client disconnected", job.endpoint)


def delta_choices(
    fmt: Formatter, choice: ChoiceState, deltas: list[CompletionDelta], echo_len: int
) -> list[dict]:
    """The chunk choices a choice's ready engine deltas become: chat reads each through the
    choice's parsers (reasoning, tool calls; text may be held back until decided) and sends
    one chunk per run of like events; completions send one chunk for them all."""
    events: list[OutputEvent] = []
    logprobs: list[tuple[CompletionDelta, int]] = []  # each delta's, with its text offset
    for delta in deltas:
        offset = echo_len + len(choice.text)
        events += choice.add(delta)
        if fmt.want_logprobs and delta.logprobs:
            logprobs.append((delta, offset))
    token_ids = [t for delta in deltas for t in delta.token_ids]
    wire_logprobs = fmt.stream_logprobs(logprobs)
    if fmt.chat:
        return fmt.event_choices(choice.index, coalesced(events), token_ids, wire_logprobs)
    text = "".join(delta.text for delta in deltas)
    if text or wire_logprobs or (fmt.want_token_ids and token_ids):
        return [fmt.text_choice(choice.index, text, token_ids, wire_logprobs)]
    return []


def coalesced(events: list[OutputEvent]) -> list[OutputEvent]:
    """Adjacent events of one kind joined: content with content, reasoning with reasoning,
    a call's argument fragments with its next ones. A call's start stays its own event."""
    out: list[OutputEvent] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + event.text)
        elif isinstance(event, ReasoningDelta) and isinstance(last, ReasoningDelta):
            out[-1] = ReasoningDelta(last.text + event.text)
        elif (
            isinstance(event, ToolCallArgsDelta)
            and isinstance(last, ToolCallArgsDelta)
            and last.index == event.index
        ):
            out[-1] = ToolCallArgsDelta(event.index, last.fragment + event.fragment)
        else:
            out.append(event)
    return out


@dataclass
class Deltas:
    """One choice's engine deltas from one pull, in order."""

    choice: ChoiceState
    deltas: list[CompletionDelta]


@dataclass
class DeadlineReached:
    """The request's deadline passed: `choice` was finished as `timeout`; `held` is the
    text its parsers still held back."""

    choice: ChoiceState
    held: list


class EngineFailed(Exception):
    """The engine failed the request after its first output (headers may be out)."""

    def __init__(self, message: str, code: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def engine_error(
    code: str | None, message: str, job: AdmittedRequest, *, retryable: bool
) -> errors.APIError:
    """The API error an engine output's error stands for (errors.engine_refusal), naming
    the request's grammar field and where its deadline was set."""
    return errors.engine_refusal(
        code,
        message,
        grammar_param=job.req.grammar_param(),
        deadline_param=job.deadline_param,
        retryable=retryable,
    )


class RequestOutputs:
    """One request's outputs, read from its merged engine streams: the one loop both response
    modes run (the SSE writer frames each event as it comes, the JSON body collects them)."""

    def __init__(self, job: AdmittedRequest) -> None:
        self.job = job
        self.choices = job.new_choices()
        self.cached = [0] * len(job.engine_requests)

    async def events(self, merged: Merged) -> AsyncIterator[Deltas | DeadlineReached]:
        """Per pull, each choice's ready deltas as one event (in the order the choices
        first appear), then what ended the request, if it ended."""
        n = self.job.n
        async for ready in merged:
            pending: dict[int, Deltas] = {}
            for i, out in ready:
                if out is None:  # the deadline: every open choice ends as `timeout`
                    for event in pending.values():
                        yield event
                    for c in self.choices:
                        if c.finish_reason is None:
                            yield DeadlineReached(c, c.finish("timeout"))
                    return
                if out.error is not None:
                    for event in pending.values():
                        yield event
                    raise EngineFailed(out.error or "the engine failed", out.error_code)
                self.cached[i] = out.num_cached_tokens
                for d in out.deltas:
                    slot = i * n + d.index
                    if slot in pending:
                        pending[slot].deltas.append(d)
                    else:
                        pending[slot] = Deltas(self.choices[slot], [d])
            for event in pending.values():
                yield event
        if any(c.finish_reason is None for c in self.choices):
            # The merged outputs end a prompt only with its last output; should they end
            # short all the same, the client reads an error: never a usage chunk after an
            # open choice, nor a body without a finish reason.
            message = "the engine stream ended before every choice finished"
            raise EngineFailed(message, "engine_lost")

    def usage(self) -> Usage:
        return self.job.usage(self.choices, self.cached)

    def settle_cancelled(self) -> None:
        """The client left: the key's budget settles to what was produced before."""
        record_usage(self.usage().total_tokens)


async def stream_sse(merged: Merged, job: AdmittedRequest) -> AsyncIterator[bytes]:
    """Pull outputs from the merged engine streams and write SSE frames, one request's
    whole stream: role deltas, content, finish chunks, usage, [DONE] (or an error frame)."""
    fmt = job.formatter
    outputs = RequestOutputs(job)
    choices = outputs.choices
    echo = job.choice_echo()
    state = StreamState(len(choices), include_usage=job.req.include_usage, role_first=fmt.chat)
    first_chunk: float | None = None
    num_chunks = 0
    # A client that leaves while this generator waits on the socket never sees it resumed
    # (no CancelledError here): its meter reads the usage so far instead.
    measure_usage(lambda: outputs.usage().total_tokens)
    try:
        for c in choices:
            if fmt.chat:
                yield state.frame_chunk(fmt.role_chunk(c.index))
            elif echo[c.index] or fmt.want_token_ids:
                yield state.frame_chunk(fmt.echo_chunk(c.index, echo[c.index]))
        try:
            async for event in outputs.events(merged):
                c = event.choice
                if isinstance(event, DeadlineReached):
                    for choice in fmt.event_choices(c.index, coalesced(event.held), [], None):
                        yield state.frame_choice(fmt.frames, choice)
                    yield state.frame_chunk(fmt.finish_chunk(c))
                    continue
                wire = delta_choices(fmt, c, event.deltas, len(echo[c.index]))
                if wire:
                    if first_chunk is None:
                        first_chunk = time.monotonic()
                        record_latency("ttft", first_chunk - job.started, job.endpoint)
                    num_chunks += 1
                for choice in wire:
                    yield state.frame_choice(fmt.frames, choice)
                if c.finish_reason is not None:
                    yield state.frame_chunk(fmt.finish_chunk(c))
        except EngineFailed as exc:
            yield state.frame_error(engine_error(exc.code, exc.message, job, retryable=False))
            yield state.frame_done()
            return
        usage = outputs.usage()
        observe_end(job, choices, usage)
        if num_chunks:
            record_tokens_per_chunk(job.endpoint, usage.completion_tokens / num_chunks)
        if first_chunk is not None and num_chunks > 1:
            # One observation per request (its mean gap): a metric call per token costs
            # the shared ingress more than it tells.
            mean_gap = (time.monotonic() - first_chunk) / (num_chunks - 1)
            record_latency("itl", mean_gap, job.endpoint)
        if job.on_complete is not None and all(c.finish_reason for c in choices):
            job.on_complete(fmt.body(choices, usage, echo))
        if job.req.include_usage:
            yield state.frame_chunk(fmt.usage_chunk(usage))
        yield state.frame_done()
    except asyncio.CancelledError:
        outputs.settle_cancelled()
        record_cancel(job)
        raise
    except Exception:
        logger.exception("stream failed after headers")
        if not state.is_closed:
            yield state.frame_error(errors.internal_error("The stream failed."))
            yield state.frame_done()


async def collect_body(merged: Merged, job: AdmittedRequest) -> dict:
    """The same loop, collected into one response body (non-streamed requests)."""
    outputs = RequestOutputs(job)
    try:
        async for event in outputs.events(merged):
            if isinstance(event, Deltas):
                for delta in event.deltas:
                    event.choice.add(delta)
    except EngineFailed as exc:
        raise engine_error(exc.code, exc.message, job, retryable=False) from None
    except asyncio.CancelledError:
        outputs.settle_cancelled()
        raise
    usage = outputs.usage()
    observe_end(job, outputs.choices, usage)
    body = job.formatter.body(outputs.choices, usage, job.choice_echo())
    if job.on_complete is not None:
        job.on_complete(body)
    return body
