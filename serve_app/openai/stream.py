"""The OpenAI stream writer: engine outputs in, SSE frames out, in the promised order
(`serve_app.openai.streaming`), plus the end-of-request metrics both response modes record."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from actors.outputs import CompletionDelta, RequestOutput
from serve_app import errors
from serve_app.access.budgets import record_usage
from serve_app.metrics import record_latency, record_outcome, record_tokens
from serve_app.openai.admission import AdmittedRequest
from serve_app.openai.format import ChoiceState, Formatter
from serve_app.openai.streaming import StreamState
from serve_app.protocol import Usage

logger = logging.getLogger(__name__)

Merged = AsyncIterator[tuple[int, RequestOutput | None]]


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


def delta_chunks(
    fmt: Formatter, choice: ChoiceState, delta: CompletionDelta, echo_len: int
) -> list[dict]:
    """The chunks one engine delta becomes: chat reads it through the choice's parsers
    (reasoning, tool calls; text may be held back until decided); completions pass it on."""
    offset = echo_len + len(choice.text)
    events = choice.add(delta)
    logprobs = delta.logprobs if fmt.want_logprobs else None
    if fmt.chat:
        return fmt.event_chunks(choice.index, events, delta.token_ids, logprobs)
    if delta.text or logprobs or (fmt.want_token_ids and delta.token_ids):
        return [fmt.content_chunk(choice.index, delta.text, delta.token_ids, logprobs, offset)]
    return []


@dataclass
class Delta:
    choice: ChoiceState
    delta: CompletionDelta


@dataclass
class DeadlineReached:
    """The request's deadline passed: `choice` was finished as `timeout`; `held` is the
    text its parsers still held back."""

    choice: ChoiceState
    held: list


class EngineFailed(Exception):
    """An engine output carried an error after the first output (headers may be out)."""


class RequestOutputs:
    """One request's outputs, read from its merged engine streams: the one loop both response
    modes run (the SSE writer frames each event as it comes, the JSON body collects them)."""

    def __init__(self, job: AdmittedRequest) -> None:
        self.job = job
        self.choices = job.new_choices()
        self.cached = [0] * len(job.engine_requests)

    async def events(self, merged: Merged) -> AsyncIterator[Delta | DeadlineReached]:
        n = self.job.n
        async for i, out in merged:
            if out is None:  # the deadline: every open choice ends as `timeout`
                for c in self.choices:
                    if c.finish_reason is None:
                        yield DeadlineReached(c, c.finish("timeout"))
                return
            if out.error is not None:
                raise EngineFailed(out.error)
            self.cached[i] = out.num_cached_tokens
            for d in out.deltas:
                yield Delta(self.choices[i * n + d.index], d)

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
                    for chunk in fmt.event_chunks(c.index, event.held, [], None):
                        yield state.frame_chunk(chunk)
                    yield state.frame_chunk(fmt.finish_chunk(c))
                    continue
                chunks = delta_chunks(fmt, c, event.delta, len(echo[c.index]))
                if chunks:
                    if first_chunk is None:
                        first_chunk = time.monotonic()
                        record_latency("ttft", first_chunk - job.started, job.endpoint)
                    num_chunks += 1
                for chunk in chunks:
                    yield state.frame_chunk(chunk)
                if c.finish_reason is not None:
                    yield state.frame_chunk(fmt.finish_chunk(c))
        except EngineFailed as exc:
            yield state.frame_error(errors.internal_error(f"The engine failed: {exc}"))
            yield state.frame_done()
            return
        usage = outputs.usage()
        observe_end(job, choices, usage)
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
            if isinstance(event, Delta):
                event.choice.add(event.delta)
    except EngineFailed as exc:
        raise errors.internal_error(f"The engine failed: {exc}", retryable=False) from None
    except asyncio.CancelledError:
        outputs.settle_cancelled()
        raise
    usage = outputs.usage()
    observe_end(job, outputs.choices, usage)
    body = job.formatter.body(outputs.choices, usage, job.choice_echo())
    if job.on_complete is not None:
        job.on_complete(body)
    return body
