"""`/v1/generations`: task-style generation resources over server-owned profiles.

Admission (authorization, profile rules, input assembly and budgets) completes before the
resource exists; then the runner owns the work (never the request: a disconnect does not
cancel a generation). sync -> 200 with the terminal resource; background -> 202 +
Location; stream -> SSE `generation.created`, `output.delta`..., `generation.finished`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from actors.sampling_params import SamplingParams
from serve_app import errors
from serve_app.auth import principal_of, require_model, require_profile
from serve_app.config import ServeConfig
from serve_app.conversations import ConversationsAPI
from serve_app.generation_protocol import GenerationCreate, idempotency_key, parse_body
from serve_app.generation_resource import new_generation_id, resource_json, usage
from serve_app.generation_runner import Event, GenerationRunner, Live, Plan
from serve_app.profiles import (
    TEXT_FORMAT,
    Profile,
    constrained_schema,
    format_instructions,
)
from serve_app.protocol.params import GrammarSpec, canonical_json
from serve_app.store import (
    ConversationTurn,
    GenerationRecord,
    IdempotencyKey,
    InsertOutcome,
    InsertResult,
    open_store,
)

logger = logging.getLogger(__name__)

OPERATION = "generations.create"


def sse_event(event: Event) -> bytes:
    name = "output.delta" if event.kind == "delta" else "generation.finished"
    return f"event: {name}\ndata: {json.dumps(event.data, separators=(',', ':'))}\n\n".encode()


class GenerationsAPI:
    def __init__(
        self,
        config: ServeConfig,
        tokenizer: Any,
        grammar: Any,
        engine: Any,
        identity: dict[str, Any],
        admit: Any = None,
    ) -> None:
        self.config = config
        self.options = config.generations
        self.identity = identity
        self.tokenizer = tokenizer
        self.admit = admit
        self.store = open_store(config.store, self.options.data_dir)
        owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.runner = GenerationRunner(
            self.store,
            engine.options(stream=True),
            grammar,
            self.options,
            owner,
            resource_json,
        )
        self.conversations = ConversationsAPI(self.store, self.options, admit)
        # Startup: resources a crashed process left queued/running become failed.
        self.runner.sweep_orphans()
        self._upkeep: asyncio.Task[None] | None = None

    def routes(self) -> list[Route]:
        conv = self.conversations
        return [
            Route("/v1/generations", self.create, methods=["POST"]),
            Route("/v1/generations/{generation_id}", self.get, methods=["GET"]),
            Route("/v1/generations/{generation_id}/cancel", self.cancel, methods=["POST"]),
            Route("/v1/conversations", conv.create, methods=["POST"]),
            Route("/v1/conversations/{conversation_id}", conv.get, methods=["GET"]),
            Route("/v1/conversations/{conversation_id}", conv.delete, methods=["DELETE"]),
        ]

    def start_upkeep(self) -> None:
        if self._upkeep is None or self._upkeep.done():
            self._upkeep = asyncio.get_running_loop().create_task(self.runner.upkeep_forever())

    # ------------------------------------------------------------------ endpoints

    async def create(self, request: Request) -> Response:
        self.start_upkeep()
        if self.admit is not None:
            await self.admit()
        body = await request.body()
        if len(body) > self.config.limits.max_body_bytes:
            raise errors.body_too_large(self.config.limits.max_body_bytes)
        req: GenerationCreate = parse_body(GenerationCreate, body)
        key = idempotency_key(request.headers.get("idempotency-key"))
        plan = await self._plan(request, req, key)
        result, live = await self.runner.submit(plan, subscribe=req.execution == "stream")
        return await self._answer(req, result, live)

    async def get(self, request: Request) -> Response:
        self.start_upkeep()
        tenant = principal_of(request).tenant
        gid = request.path_params["generation_id"]
        record = await asyncio.to_thread(self.store.get_generation, tenant, gid)
        if record is None:
            raise not_found(gid)
        return JSONResponse(resource_json(record))

    async def cancel(self, request: Request) -> Response:
        self.start_upkeep()
        tenant = principal_of(request).tenant
        gid = request.path_params["generation_id"]
        record = await self.runner.cancel(tenant, gid)
        if record is None:
            raise not_found(gid)
        return JSONResponse(resource_json(record))

    # ------------------------------------------------------------------ admission

    async def _plan(self, request: Request, req: GenerationCreate, key: str | None) -> Plan:
        principal = principal_of(request)
        profile = self.options.profile(req.profile)
        if profile is None:
            raise errors.not_found(
                "profile_not_found", f"No generation profile '{req.profile}'.", "profile"
            )
        require_profile(principal, profile.name)
        model = self._model(profile, req)
        require_model(principal, model)
        output_format = self._output_format(profile, req)
        max_output = self._max_output(profile, req)
        history: list[dict[str, Any]] = []
        turn = None
        if req.conversation is not None:
            conv = await asyncio.to_thread(
                self.store.get_conversation, principal.tenant, req.conversation.id
            )
            if conv is None:
                raise conversation_not_found(req.conversation.id)
            history = conv.messages
            turn = ConversationTurn(conv.id, req.conversation.expected_revision)
        new_messages = req.input_messages()
        schema = self.options.output_formats.get(output_format)
        messages = self._system(profile, output_format, schema) + history + new_messages
        prompt_ids = await self.tokenizer.render_chat.remote(messages, add_generation_prompt=True)
        self._check_budget(profile, len(prompt_ids), max_output)
        plan = self._build_plan(
            principal.tenant, profile, req, model, output_format, prompt_ids, max_output
        )
        plan.turn = turn
        plan.turn_messages = new_messages
        if key is not None:
            expires_at = time.time() + self.options.idempotency_ttl_s
            plan.idempotency = IdempotencyKey(OPERATION, key, req.body_hash(), expires_at)
        return plan

    def _build_plan(
        self,
        tenant: str,
        profile: Profile,
        req: GenerationCreate,
        model: str,
        output_format: str,
        prompt_ids: list[int],
        max_output: int,
    ) -> Plan:
        now = time.time()
        schema = self.options.output_formats.get(output_format)
        grammar = None
        if schema is not None:
            grammar = GrammarSpec("json_schema", canonical_json(constrained_schema(schema)))
        conversation = None
        if req.conversation is not None:
            conversation = req.conversation.model_dump()
        data = {
            "profile": {"name": profile.name, "version": profile.version},
            "resolved_model": model,
            "artifact": self._artifact(),
            "execution": req.execution,
            "output_format": output_format,
            "max_output_tokens": max_output,
            "conversation": conversation,
            "input_revision": "sha256:" + sha256_ids(prompt_ids),
            "output": [],
            "finish_reason": None,
            "usage": usage(len(prompt_ids), 0, 0, "estimate"),
            "error": None,
            "started_at": None,
            "finished_at": None,
        }
        record = GenerationRecord(
            new_generation_id(), tenant, "queued", self.runner.owner, data, now, now, None
        )
        return Plan(
            record=record,
            prompt_ids=prompt_ids,
            params=SamplingParams(
                max_tokens=max_output, temperature=profile.temperature, top_p=profile.top_p
            ),
            grammar=grammar,
            output_format=output_format,
            schema=schema,
            deadline=now + self.options.deadline_s,
        )

    def _artifact(self) -> dict[str, Any]:
        ident = self.identity
        grammar = ident.get("grammar", {})
        return {
            "fingerprint": ident.get("fingerprint"),
            "weights_sha256": ident.get("weights_sha256"),
            "tokenizer_sha256": ident.get("tokenizer_sha256"),
            "chat_template_sha256": ident.get("chat_template_sha256"),
            "grammar_backend": f"{grammar.get('backend')}=={grammar.get('backend_version')}",
        }

    def _model(self, profile: Profile, req: GenerationCreate) -> str:
        allowed = profile.models or (self.config.model_id,)
        model = req.model or allowed[0]
        if model not in allowed:
            raise errors.profile_mismatch(
                "model_not_allowed",
                f"Profile '{profile.name}' runs on {', '.join(allowed)}, not '{model}'.",
                "model",
            )
        return model

    def _output_format(self, profile: Profile, req: GenerationCreate) -> str:
        fmt = req.output_format or profile.default_output_format
        if fmt not in profile.output_formats:
            raise errors.profile_mismatch(
                "output_format_not_allowed",
                f"Profile '{profile.name}' offers the output formats "
                f"{', '.join(profile.output_formats)}, not '{fmt}'.",
                "output_format",
            )
        if fmt != TEXT_FORMAT and not self.identity.get("grammar", {}).get("available"):
            raise errors.unsupported_parameter(
                "output_format", "structured output is unavailable on this server"
            )
        return fmt

    def _max_output(self, profile: Profile, req: GenerationCreate) -> int:
        requested = req.max_output_tokens or profile.default_max_output_tokens
        if requested > profile.max_output_tokens:
            raise errors.max_tokens_exceeded(
                f"max_output_tokens is {requested}; profile '{profile.name}' allows at most "
                f"{profile.max_output_tokens}.",
                status=422,
                param="max_output_tokens",
            )
        return requested

    def _system(
        self, profile: Profile, output_format: str, schema: dict[str, Any] | None
    ) -> list[dict[str, Any]]:
        parts = [profile.instructions] if profile.instructions else []
        if schema is not None:
            parts.append(format_instructions(output_format, schema))
        return [{"role": "system", "content": "\n\n".join(parts)}] if parts else []

    def _check_budget(self, profile: Profile, num_input: int, max_output: int) -> None:
        context = self.identity["max_model_len"]
        budget = profile.input_budget_tokens
        if budget is not None and num_input > budget:
            raise errors.context_length_exceeded(
                f"The assembled input (instructions, history and input) has {num_input} "
                f"tokens; profile '{profile.name}' has an input budget of {budget} tokens.",
                status=422,
                param="input",
            )
        if num_input + max_output > context:
            raise errors.context_length_exceeded(
                f"The assembled input has {num_input} tokens and max_output_tokens is "
                f"{max_output}: {num_input + max_output} exceeds the model's context of "
                f"{context} tokens.",
                status=422,
                param="input",
            )

    # ------------------------------------------------------------------- response

    async def _answer(self, req: GenerationCreate, result: InsertResult, live: Live) -> Response:
        outcome = result.outcome
        if outcome is InsertOutcome.KEY_REUSED:
            raise errors.conflict(
                "idempotency_key_reused",
                "This Idempotency-Key was used with a different request; use a new key for "
                "new work.",
            )
        if outcome is InsertOutcome.CONVERSATION_NOT_FOUND:
            assert req.conversation is not None
            raise conversation_not_found(req.conversation.id)
        if outcome is InsertOutcome.STALE_REVISION:
            assert req.conversation is not None and result.conversation is not None
            conv = result.conversation
            busy = " (another turn is in progress)" if conv.pending_generation else ""
            raise errors.conflict(
                "stale_revision",
                f"Conversation '{conv.id}' is at revision {conv.revision}{busy}; this request "
                f"expected revision {req.conversation.expected_revision}.",
            )
        if outcome is InsertOutcome.REPLAY:
            assert result.generation is not None
            return await self._replay(req, result.generation)
        record = live.plan.record
        location = {"Location": f"/v1/generations/{record.id}"}
        if req.execution == "background":
            return JSONResponse(resource_json(record), status_code=202, headers=location)
        if req.execution == "stream":
            sub = live.subscribers[0]
            return StreamingResponse(
                self._sse(live, sub, resource_json(record)),
                media_type="text/event-stream",
                headers={**location, "Cache-Control": "no-cache"},
            )
        final = await asyncio.shield(live.done)
        return JSONResponse(resource_json(final), headers=location)

    async def _replay(self, req: GenerationCreate, record: GenerationRecord) -> Response:
        """The same generation as JSON, never a new stream; a sync replay of a generation
        still running here waits for its end, as the original request would have."""
        live = self.runner.live.get(record.id)
        if req.execution == "sync" and live is not None:
            record = await asyncio.shield(live.done)
        headers = {"Location": f"/v1/generations/{record.id}", "Idempotent-Replayed": "true"}
        status = 202 if req.execution == "background" and not record.is_terminal else 200
        return JSONResponse(resource_json(record), status_code=status, headers=headers)

    async def _sse(self, live: Live, sub: Any, created: dict[str, Any]) -> AsyncIterator[bytes]:
        try:
            yield f"event: generation.created\ndata: {json.dumps(created)}\n\n".encode()
            while True:
                event = await sub.queue.get()
                yield sse_event(event)
                if event.kind == "finished":
                    return
        finally:
            live.unsubscribe(sub)


def sha256_ids(token_ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()


def not_found(generation_id: str) -> errors.APIError:
    return errors.not_found(
        "generation_not_found", f"No generation '{generation_id}'.", "generation_id"
    )


def conversation_not_found(conversation_id: str) -> errors.APIError:
    return errors.not_found(
        "conversation_not_found", f"No conversation '{conversation_id}'.", "conversation.id"
    )
