"""The OpenAI-compatible endpoints: admission (parse, limits, template, grammar) completes
before any header is sent; then outputs are framed as one JSON body or an ordered stream."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from actors.outputs import RequestOutput
from serve_app import errors
from serve_app.access.keys import principal_of
from serve_app.access.static_limits import check_request
from serve_app.backpressure.proxy_hold import flow_header
from serve_app.backpressure.proxy_hold import is_enabled as proxy_flow_enabled
from serve_app.backpressure.stalled_streams import board_name
from serve_app.config.options import ServeConfig
from serve_app.openai.admission import AdmittedRequest, OpenAIAdmission
from serve_app.openai.request_ids import HEADER as REQUEST_ID_HEADER
from serve_app.openai.request_ids import RequestIds
from serve_app.openai.stream import (
    Merged,
    Ready,
    collect_body,
    engine_error,
    record_cancel,
    stream_sse,
)
from serve_app.openai.token_text import load_token_texts
from serve_app.parsers.chat_output import PROMPT_TAIL, chat_parse_options
from serve_app.protocol import parse_request
from serve_app.protocol.parsing import check_token_ids
from serve_app.workers.output_channel import EngineChannels, Mailbox, Routed

logger = logging.getLogger(__name__)


class OpenAIHandlers:
    def __init__(self, config: ServeConfig, tokenizer, grammar, engine, identity: dict, admit=None):
        self.config = config
        self.identity = identity
        self.tokenizer = tokenizer
        self.engine = engine.options(stream=True)
        self.channels = EngineChannels(self.engine)
        self.texts = load_token_texts(config.model)
        self.admission = OpenAIAdmission(config, identity, self.texts, grammar)
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
        check_request(principal_of(request), req, self.config.limits)
        return await self.request_ids.guard(
            request.headers.get(REQUEST_ID_HEADER),
            principal_of(request).tenant,
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
            tools=req.tools,
            chat_template_kwargs=req.chat_template_kwargs,
        )
        parse = chat_parse_options(req, self.texts.tokenizer.decode(prompt_ids[-PROMPT_TAIL:]))
        job = await self.admission.admit(
            req, [prompt_ids], "messages", chat=True, echo=[""], request=request, parse=parse
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
                check_token_ids(p, self.identity["vocab_size"], "prompt")
                ids_list.append(p)
        echo = [
            (p if isinstance(p, str) else self.texts.tokenizer.decode(p)) if req.echo else ""
            for p in prompts
        ]
        job = await self.admission.admit(
            req, ids_list, "prompt", chat=False, echo=echo, request=request
        )
        job.on_complete = record
        return await self._respond(job, request)

    # ------------------------------------------------------------------- parsing
    def _parse(self, body: bytes, kind: str):
        req = parse_request(kind, body)
        if req.model != self.config.model_id:
            raise errors.not_found(
                "model_not_found", f"The model '{errors.echo(req.model)}' does not exist.", "model"
            )
        return req

    # ------------------------------------------------------------------- response
    async def _respond(self, job: AdmittedRequest, request: Request) -> Response:
        headers = {}
        if job.req.stream and proxy_flow_enabled():
            # The proxy pauses this key while the client's socket is full; the engine holds.
            key = uuid.uuid4().hex
            for r in job.engine_requests:
                r.flow_key = key
            name, value = flow_header(board_name(self.config.model_id), key)
            headers[name] = value
        boxes = []
        for r in job.engine_requests:
            r.channel = self.channels.channel_id
            boxes.append(self.channels.expect(r.request_id))
        streams = [self.engine.generate.remote(r) for r in job.engine_requests]
        firsts = []
        try:
            for prompt_idx, gen in enumerate(streams):
                firsts.append(await self._first(gen, job, prompt_idx, boxes[prompt_idx]))
        except BaseException:
            for gen in streams:
                gen.cancel()
            for box in boxes:
                self.channels.release(box.request_id)
            raise
        # The prompt's logprobs ride on each prompt's first output.
        job.formatter.prompt_logprobs = [first.prompt_logprobs for first in firsts]
        merged = merged_outputs(streams, boxes, firsts, job.deadline, self.channels)
        if job.req.stream:
            return StreamingResponse(
                stream_sse(merged, job), media_type="text/event-stream", headers=headers
            )
        try:
            return await self._collect(merged, job)
        except asyncio.CancelledError:
            record_cancel(job)
            raise

    async def _first(
        self, gen, job: AdmittedRequest, prompt_idx: int, box: Mailbox
    ) -> RequestOutput:
        """The first output decides the status: a grammar that failed is a 400 here."""
        try:
            out = await gen.__anext__()
            if isinstance(out, Routed):  # where the later outputs come
                self.channels.routed(box, out)
                out = await gen.__anext__()
        except errors.APIError as exc:  # the engine deployment's own (Ray wraps it: unwrap)
            raise errors.api_error_in(exc) or exc from None
        except ValueError as exc:
            raise errors.invalid_request(str(exc), "prompt") from exc
        except Exception as exc:
            logger.error("engine refused request: %s", type(exc).__name__)
            raise errors.internal_error("The engine is unavailable.", retryable=True) from exc
        if out.error is not None or out.error_code is not None:
            # Nothing was sent yet: a repeat is safe.
            message = out.error or out.error_code or "the engine failed"
            raise engine_error(out.error_code, message, job, retryable=True)
        return out

    async def _collect(self, merged, job: AdmittedRequest) -> Response:
        return JSONResponse(await collect_body(merged, job))


async def merged_outputs(
    streams: list,
    boxes: list[Mailbox],
    firsts: list[RequestOutput],
    deadline: float | None,
    channels: EngineChannels,
) -> Merged:
    """Every prompt's outputs from its stream or channel mailbox, as what is ready at each
    pull (never waiting for more than the first), ending at the deadline. A prompt ends only
    with its last output: an engine call that stops short of it ends the prompt as
    `engine_lost`, never as a short success and never as a wait for what will not come."""
    queue: asyncio.Queue[tuple[int, RequestOutput | None]] = asyncio.Queue()

    def deliver(i: int, out: RequestOutput) -> None:
        queue.put_nowait((i, out))
        if out.finished:
            queue.put_nowait((i, None))

    async def pump(i: int, gen, box: Mailbox) -> None:
        # The call's outputs go through the mailbox too: it takes nothing after the last.
        box.attach(lambda out: deliver(i, out))
        try:
            async for out in gen:
                box.put(out)  # channelled: nothing more, unless its channel closed under it
        except (Exception, asyncio.CancelledError) as exc:
            if asyncio.current_task().cancelling():
                # The reader left (the merge is closing): nothing more is wanted. The handle
                # may answer that cancel with its own RequestCancelledError: the same end,
                # and no one awaits this task to retrieve it.
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return
            # The replica or its worker died, or Serve cancelled the call under its reader
            # (it cancels a leaving client's handle calls before its writer hears of it,
            # and raises CancelledError in whoever reads them). The engine request is gone
            # either way, and nothing it started is re-run elsewhere.
            if isinstance(exc, asyncio.CancelledError):
                logger.info("engine call cancelled under its reader (its client left?)")
                box.fail("the engine call was cancelled")
            else:
                logger.error("engine stream lost: %s", type(exc).__name__)
                box.fail("the engine replica was lost")
            return
        if box.instance is None:  # unchannelled: the call's end is the request's end
            box.fail("the engine stream ended before the request finished")

    pending = 0
    tasks = []
    for i, (gen, box, first) in enumerate(zip(streams, boxes, firsts, strict=True)):
        await queue.put((i, first))
        if not first.finished:
            pending += 1
            tasks.append(asyncio.create_task(pump(i, gen, box)))
    try:
        while pending or not queue.empty():
            timeout = None if deadline is None else deadline - time.monotonic()
            try:
                item = await asyncio.wait_for(queue.get(), timeout)
            except TimeoutError:
                yield [(-1, None)]  # deadline: the caller ends the open choices
                return
            ready: Ready = []
            while True:  # and whatever else came meanwhile (the writer fell behind)
                if item[1] is None:
                    pending -= 1
                else:
                    ready.append(item)
                if queue.empty():
                    break
                item = queue.get_nowait()
            if ready:
                yield ready
    finally:
        for task in tasks:
            task.cancel()
        for gen in streams:
            gen.cancel()
        for box in boxes:
            channels.release(box.request_id)
