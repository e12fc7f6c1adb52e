"""The OpenAI stream writer: engine outputs in, SSE frames out, in the promised order
(`serve_app.openai.streaming`), plus the end-of-request metrics both response modes record."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

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


async def stream_sse(merged: Merged, job: AdmittedRequest) -> AsyncIterator[bytes]:
    """Pull outputs from the merged engine streams and write SSE frames, one request's
    whole stream: role deltas, content, finish chunks, usage, [DONE] (or an error frame)."""
    fmt = job.formatter
    choices = job.new_choices()
    echo = job.choice_echo()
    state = StreamState(len(choices), include_usage=job.req.include_usage, role_first=fmt.chat)
    cached = [0] * len(job.engine_requests)
    first_chunk: float | None = None
    num_chunks = 0
    try:
        for c in choices:
            if fmt.chat:
                yield state.frame_chunk(fmt.role_chunk(c.index))
            elif echo[c.index] or fmt.want_token_ids:
                yield state.frame_chunk(fmt.echo_chunk(c.index, echo[c.index]))
        async for i, out in merged:
            if out is None:
                for c in choices:
                    if c.finish_reason is None:
                        held = c.finish("timeout")
                        for chunk in fmt.event_chunks(c.index, held, [], None):
                            yield state.frame_chunk(chunk)
                        yield state.frame_chunk(fmt.finish_chunk(c))
                break
            if out.error is not None:
                err = errors.internal_error(f"The engine failed: {out.error}")
                yield state.frame_error(err)
                yield state.frame_done()
                return
            cached[i] = out.num_cached_tokens
            for d in out.deltas:
                c = choices[i * job.n + d.index]
                chunks = delta_chunks(fmt, c, d, len(echo[c.index]))
                if chunks:
                    if first_chunk is None:
                        first_chunk = time.monotonic()
                        record_latency("ttft", first_chunk - job.started, job.endpoint)
                    num_chunks += 1
                for chunk in chunks:
                    yield state.frame_chunk(chunk)
                if c.finish_reason is not None:
                    yield state.frame_chunk(fmt.finish_chunk(c))
        usage = job.usage(choices, cached)
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
        # The key's budget settles to what was produced before the client left.
        record_usage(job.usage(choices, cached).total_tokens)
        record_cancel(job)
        raise
    except Exception:
        logger.exception("stream failed after headers")
        if not state.is_closed:
            yield state.frame_error(errors.internal_error("The stream failed."))
            yield state.frame_done()
