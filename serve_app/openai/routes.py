"""The OpenAI-compatible endpoints: admission (parse, limits, template, grammar) completes
before any header is sent; then outputs are framed as one JSON body or an ordered stream."""

from __future__ import annotations

import asyncio
import logging
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

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
from serve_app.openai.stream import collect_body, engine_error, record_cancel, stream_sse
from serve_app.openai.token_text import load_token_texts
from serve_app.parsers.chat_output import PROMPT_TAIL, chat_parse_options
from serve_app.protocol import parse_request
from serve_app.protocol.event_stream import EventStreamResponse
from serve_app.protocol.parsing import check_token_ids, load_json_object
from serve_app.workers.merged_outputs import merged_outputs
from serve_app.workers.output_channel import EngineChannels, Mailbox

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
        data = load_json_object(body)  # once: the request and its id's record both read it
        req = self._parse(data, kind)
        check_request(principal_of(request), req, self.config.limits)
        return await self.request_ids.guard(
            request.headers.get(REQUEST_ID_HEADER),
            principal_of(request).tenant,
            data,
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
    def _parse(self, data: dict, kind: str):
        req = parse_request(kind, data)
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
            return EventStreamResponse(
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
            out = await self.channels.first_output(gen, box)
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
