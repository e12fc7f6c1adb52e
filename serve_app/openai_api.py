"""The OpenAI-compatible endpoints: admission (parse, limits, template, grammar) completes
before any header is sent; then outputs are framed as one JSON body or an ordered stream."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from actors.messages import EngineRequest
from actors.outputs import RequestOutput
from serve_app import errors
from serve_app.config import ServeConfig
from serve_app.metrics import record_latency, record_outcome, record_tokens
from serve_app.openai_format import ChoiceState, Formatter
from serve_app.protocol import Usage, new_id, parse_request
from serve_app.request_ids import HEADER as REQUEST_ID_HEADER
from serve_app.request_ids import RequestIds
from serve_app.streaming import StreamState
from serve_app.token_text import TokenTexts

logger = logging.getLogger(__name__)


TIMEOUT_HEADER = "x-request-timeout-ms"
# Until API keys name tenants, every caller shares one identity namespace.
DEFAULT_TENANT = "default"


def client_timeout_s(request: Request, req) -> float | None:
    """The client's deadline: the `X-Request-Timeout-Ms` header or the `timeout` field
    (seconds); the stricter one wins when both are given."""
    candidates = [req.timeout] if req.timeout else []
    header = request.headers.get(TIMEOUT_HEADER)
    if header is not None:
        try:
            ms = float(header)
        except ValueError:
            raise errors.invalid_request(f"{TIMEOUT_HEADER} must be a number", "timeout") from None
        if not ms > 0:
            raise errors.invalid_request(f"{TIMEOUT_HEADER} must be > 0", "timeout")
        candidates.append(ms / 1000.0)
    return min(candidates) if candidates else None


@dataclass
class Job:
    """An admitted request: one engine request per prompt, all validated."""

    req: Any
    formatter: Formatter
    engine_requests: list[EngineRequest]
    echo: list[str]
    n: int
    deadline: float | None
    # Records the terminal (non-streamed) body before the terminal event is sent.
    on_complete: Callable[[dict], None] | None = None
    started: float = 0.0


class OpenAIHandlers:
    def __init__(self, config: ServeConfig, tokenizer, grammar, engine, identity: dict, admit=None):
        from transformers import AutoTokenizer

        self.config = config
        self.identity = identity
        self.max_model_len: int = identity["max_model_len"]
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.engine = engine.options(stream=True)
        self.texts = TokenTexts(AutoTokenizer.from_pretrained(config.model))
        # Server-wide admission (draining); runs before any parsing.
        self.admit = admit
        self.request_ids = RequestIds(config.request_id_retention_s)

    # ------------------------------------------------------------------ endpoints
    async def chat(self, request: Request) -> Response:
        return await self._identified(request, "chat", self._chat)

    async def completions(self, request: Request) -> Response:
        return await self._identified(request, "completion", self._completions)

    async def _identified(self, request: Request, kind: str, handler) -> Response:
        """Admission, then the request-id guard around the endpoint's own work."""
        if self.admit is not None:
            await self.admit()
        body = await request.body()
        if len(body) > self.config.limits.max_body_bytes:
            raise errors.body_too_large(self.config.limits.max_body_bytes)
        req = self._parse(body, kind)
        return await self.request_ids.guard(
            request.headers.get(REQUEST_ID_HEADER),
            DEFAULT_TENANT,
            body,
            bool(req.stream),
            req.include_usage,
            lambda record: handler(req, request, record),
        )

    async def _chat(self, req, request: Request, record) -> Response:
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        prompt_ids = await self.tokenizer.render_chat.remote(
            messages,
            add_generation_prompt=req.wants_generation_prompt,
            continue_final_message=bool(req.continue_final_message),
            chat_template_kwargs=req.chat_template_kwargs,
        )
        job = await self._admit(
            req, [prompt_ids], "messages", chat=True, echo=[""], request=request
        )
        job.on_complete = record
        return await self._respond(job, request)

    async def _completions(self, req, request: Request, record) -> Response:
        prompts = req.prompts()
        if len(prompts) > self.config.limits.max_prompts_per_request:
            raise errors.invalid_request(
                f"at most {self.config.limits.max_prompts_per_request} prompts per request",
                "prompt",
            )
        ids_list = []
        for p in prompts:
            if isinstance(p, str):
                ids_list.append(await self.tokenizer.encode.remote(p))
            else:
                await self.tokenizer.check_token_ids.remote(p, "prompt")
                ids_list.append(p)
        echo = [
            (p if isinstance(p, str) else self.texts.tokenizer.decode(p)) if req.echo else ""
            for p in prompts
        ]
        job = await self._admit(req, ids_list, "prompt", chat=False, echo=echo, request=request)
        job.on_complete = record
        return await self._respond(job, request)

    # ------------------------------------------------------------------ admission
    def _parse(self, body: bytes, kind: str):
        req = parse_request(kind, body)
        if req.model != self.config.model_id:
            raise errors.not_found(
                "model_not_found", f"The model '{req.model}' does not exist.", "model"
            )
        return req

    async def _admit(
        self,
        req,
        prompts: list[list[int]],
        prompt_param: str,
        *,
        chat: bool,
        echo: list[str],
        request: Request,
    ) -> Job:
        limit = self.max_model_len
        requested = req.requested_max_tokens()
        cap = self.config.limits.max_output_tokens
        if requested is not None and cap is not None and requested > cap:
            raise errors.max_tokens_exceeded(
                f"max_tokens is {requested}; this server allows at most {cap}."
            )
        shortest_room = limit
        for ids in prompts:
            if len(ids) >= limit:
                raise errors.context_length_exceeded(
                    f"This model's maximum context length is {limit} tokens; the prompt has "
                    f"{len(ids)} tokens, leaving no room for output.",
                    param=prompt_param,
                )
            if requested is not None and len(ids) + requested > limit:
                raise errors.max_tokens_exceeded(
                    f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {len(ids) + requested} tokens ({len(ids)} in the "
                    f"{prompt_param}, {requested} in the completion)."
                )
            shortest_room = min(shortest_room, limit - len(ids))
        default_max = shortest_room if cap is None else min(shortest_room, cap)
        req.check_common(requested or default_max)
        params = req.to_sampling_params(default_max)
        grammar = await self._start_grammar(req)
        prefix = "chatcmpl" if chat else "cmpl"
        formatter = Formatter(
            chat=chat,
            response_id=new_id(prefix),
            model=self.config.model_id,
            fingerprint=self.identity["fingerprint"],
            texts=self.texts,
            want_logprobs=params.logprobs is not None,
        )
        timeout_s = client_timeout_s(request, req)
        engine_requests = [
            EngineRequest(uuid.uuid4().hex, ids, params, grammar=grammar, timeout_s=timeout_s)
            for ids in prompts
        ]
        # The engine enforces the deadline; this one only guards against a lost engine.
        deadline = time.monotonic() + timeout_s + 5.0 if timeout_s else None
        job = Job(req, formatter, engine_requests, echo, params.n, deadline)
        job.started = time.monotonic()
        return job

    async def _start_grammar(self, req) -> list[object] | None:
        spec = req.grammar_spec()
        if spec is None:
            return None
        param = req.grammar_param()
        if not self.identity.get("grammar", {}).get("available"):
            raise errors.unsupported_parameter(
                param or "response_format", "structured output is unavailable on this server"
            )
        if len(spec.spec.encode()) > self.config.grammar.max_spec_bytes:
            raise errors.invalid_request(
                f"grammar spec is larger than {self.config.grammar.max_spec_bytes} bytes", param
            )
        # Boxed so the engine call does not wait for it: prefill overlaps compilation.
        ref = await self.grammar.compile.remote(spec)._to_object_ref()
        return [ref]

    # ------------------------------------------------------------------- response
    async def _respond(self, job: Job, request: Request) -> Response:
        streams = [self.engine.generate.remote(r) for r in job.engine_requests]
        firsts = []
        try:
            for prompt_idx, gen in enumerate(streams):
                firsts.append(await self._first(gen, job, prompt_idx))
        except BaseException:
            for gen in streams:
                gen.cancel()
            raise
        merged = self._merge(streams, firsts, job)
        if job.req.stream:
            return StreamingResponse(self._sse(merged, job), media_type="text/event-stream")
        return await self._collect(merged, job)

    async def _first(self, gen, job: Job, prompt_idx: int) -> RequestOutput:
        """The first output decides the status: a grammar that failed is a 400 here."""
        try:
            out = await gen.__anext__()
        except ValueError as exc:
            raise errors.invalid_request(str(exc), "prompt") from exc
        except Exception as exc:
            logger.error("engine refused request: %s", type(exc).__name__)
            raise errors.internal_error("The engine is unavailable.", retryable=True) from exc
        if out.error_code == "invalid_grammar":
            raise errors.invalid_grammar(out.error or "grammar failed", job.req.grammar_param())
        if out.error_code == "deadline_too_short":
            raise errors.deadline_too_short(out.error or "deadline too short")
        if out.error_code == "deadline_unmeetable":
            raise errors.deadline_unmeetable(out.error or "queue too long", retry_after_s=1.0)
        if out.error is not None:
            raise errors.internal_error(f"The engine failed: {out.error}", retryable=True)
        return out

    async def _merge(
        self, streams: list, firsts: list[RequestOutput], job: Job
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from every prompt's stream, ending at the deadline."""
        queue: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

        async def pump(i: int, gen) -> None:
            try:
                async for out in gen:
                    await queue.put((i, out))
            finally:
                await queue.put((i, None))

        pending = 0
        tasks = []
        for i, (gen, first) in enumerate(zip(streams, firsts, strict=True)):
            await queue.put((i, first))
            if not first.finished:
                pending += 1
                tasks.append(asyncio.create_task(pump(i, gen)))
        try:
            while pending or not queue.empty():
                timeout = None if job.deadline is None else job.deadline - time.monotonic()
                try:
                    i, out = await asyncio.wait_for(queue.get(), timeout)
                except TimeoutError:
                    yield -1, None  # deadline: the caller ends the open choices
                    return
                if out is None:
                    pending -= 1
                    continue
                yield i, out
        finally:
            for task in tasks:
                task.cancel()
            for gen in streams:
                gen.cancel()

    def _choices(self, job: Job) -> list[ChoiceState]:
        return [ChoiceState(i) for i in range(len(job.engine_requests) * job.n)]

    async def _collect(self, merged, job: Job) -> Response:
        choices = self._choices(job)
        cached = [0] * len(job.engine_requests)
        async for i, out in merged:
            if out is None:
                for c in choices:
                    if c.finish_reason is None:
                        c.finish("timeout")
                break
            if out.error is not None:
                raise errors.internal_error(f"The engine failed: {out.error}", retryable=False)
            cached[i] = out.num_cached_tokens
            for d in out.deltas:
                choices[i * job.n + d.index].add(d)
        usage = self._usage(job, choices, cached)
        self._observe_end(job, choices, usage)
        body = job.formatter.body(choices, usage, self._echo(job))
        if job.on_complete is not None:
            job.on_complete(body)
        return JSONResponse(body)

    def _observe_end(self, job: Job, choices: list[ChoiceState], usage: Usage) -> None:
        endpoint = "chat" if job.formatter.chat else "completions"
        record_latency("e2e", time.monotonic() - job.started, endpoint)
        for c in choices:
            record_outcome(endpoint, c.finish_reason or "unknown")
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        record_tokens(endpoint, usage.prompt_tokens, usage.completion_tokens, cached)

    def _echo(self, job: Job) -> list[str]:
        return [job.echo[c // job.n] for c in range(len(job.engine_requests) * job.n)]

    def _usage(self, job: Job, choices: list[ChoiceState], cached: list[int]) -> Usage:
        prompt_tokens = sum(len(r.prompt_token_ids) for r in job.engine_requests)
        return Usage.of(prompt_tokens, sum(c.num_tokens for c in choices), sum(cached))

    async def _sse(self, merged, job: Job) -> AsyncIterator[bytes]:
        fmt = job.formatter
        choices = self._choices(job)
        echo = self._echo(job)
        state = StreamState(len(choices), include_usage=job.req.include_usage, role_first=fmt.chat)
        cached = [0] * len(job.engine_requests)
        endpoint = "chat" if fmt.chat else "completions"
        first_chunk: float | None = None
        num_chunks = 0
        try:
            for c in choices:
                if fmt.chat:
                    yield state.frame_chunk(fmt.role_chunk(c.index))
                elif echo[c.index]:
                    yield state.frame_chunk(fmt.content_chunk(c.index, echo[c.index], [], None, 0))
            async for i, out in merged:
                if out is None:
                    for c in choices:
                        if c.finish_reason is None:
                            c.finish("timeout")
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
                    offset = len(echo[c.index]) + len(c.text)
                    c.add(d)
                    if d.text or d.logprobs:
                        if first_chunk is None:
                            first_chunk = time.monotonic()
                            record_latency("ttft", first_chunk - job.started, endpoint)
                        num_chunks += 1
                        lp = d.logprobs if fmt.want_logprobs else None
                        yield state.frame_chunk(
                            fmt.content_chunk(c.index, d.text, d.token_ids, lp, offset)
                        )
                    if c.finish_reason is not None:
                        yield state.frame_chunk(fmt.finish_chunk(c))
            usage = self._usage(job, choices, cached)
            self._observe_end(job, choices, usage)
            if first_chunk is not None and num_chunks > 1:
                # One observation per request (its mean gap): a metric call per token costs
                # the shared ingress more than it tells.
                mean_gap = (time.monotonic() - first_chunk) / (num_chunks - 1)
                record_latency("itl", mean_gap, endpoint)
            if job.on_complete is not None and all(c.finish_reason for c in choices):
                job.on_complete(fmt.body(choices, usage, echo))
            if job.req.include_usage:
                yield state.frame_chunk(fmt.usage_chunk(usage))
            yield state.frame_done()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("stream failed after headers")
            if not state.is_closed:
                yield state.frame_error(errors.internal_error("The stream failed."))
                yield state.frame_done()
