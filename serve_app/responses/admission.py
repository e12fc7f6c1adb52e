"""Admission of a response: the chain it continues, the chat request it runs as, the
template, the context budget, the key's limits, the grammar. Everything here happens before
any header is sent and before any KV block is allocated; every refusal names its field."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from actors.messages import EngineRequest
from serve_app import errors
from serve_app.access.budgets import LIMITER_STATE_KEY, reserve_budget
from serve_app.access.keys import principal_of, require_model
from serve_app.access.output_budget import BudgetRules, output_budget, server_and_key_caps
from serve_app.access.prefix_scope import prefix_namespace
from serve_app.access.static_limits import check_prompt_tokens, check_request
from serve_app.config.options import ServeConfig
from serve_app.grammar.spec import GrammarSpec
from serve_app.parsers.chat_output import PROMPT_TAIL, ParseOptions, chat_parse_options
from serve_app.protocol import ChatCompletionRequest, parse_request
from serve_app.protocol.deadlines import client_timeout_s
from serve_app.resources.conversations import read_history, stale_revision
from serve_app.responses.chat_request import chat_body, chat_messages, renamed
from serve_app.responses.output import new_item_id
from serve_app.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ReasoningItem,
    ResponseCreate,
    parse_item,
)
from serve_app.store.base import Store
from serve_app.workers.constraint import compile_grammar, grammar_spec

# The Responses API's wording of an output-budget refusal: OpenAI's 400, naming the input
# that overflows the context (truncation is "disabled": nothing is cut).
RESPONSE_RULES = BudgetRules(
    param="max_output_tokens",
    status=400,
    overflow_code="context_length_exceeded",
    overflow_param="input",
)
# Beyond the client's deadline: how long to wait for an engine that went silent.
ENGINE_SILENCE_GRACE_S = 5.0


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


async def reserve_detached(
    request: Request, principal: Any, num_prompt_tokens: int, max_tokens: int
) -> Callable[[int], None] | None:
    """A stored response's reservation against the key's budgets (429 naming the limit),
    held until the response ends, not until its HTTP answer does (a background one answers
    at once); the returned call settles it to measured usage."""
    limiter = (request.scope.get("state") or {}).get(LIMITER_STATE_KEY)
    if limiter is None:
        return None
    reservation_id = await limiter.reserve_detached(principal, num_prompt_tokens, max_tokens)
    if reservation_id is None:
        return None
    return limiter.settlement(principal.key_id, reservation_id)


def response_not_found(response_id: str, param: str | None = None) -> errors.APIError:
    return errors.not_found(
        "response_not_found",
        f"No response '{errors.echo(response_id)}' (responses sent with store: false, deleted "
        "or past the retention window are not kept).",
        param,
    )


@dataclass
class AdmittedResponse:
    """A response admitted to run: its request, ids, chain and engine request."""

    req: ResponseCreate
    chat: ChatCompletionRequest
    tenant: str
    response_id: str
    created_at: float
    engine_request: EngineRequest
    parse: ParseOptions
    # The input items as `input_items` lists them, and the chat turns of the whole chain
    # (without instructions: those of a previous response are not carried over).
    input_items: list[dict[str, Any]] = field(default_factory=list)
    context: list[dict[str, Any]] = field(default_factory=list)
    deadline: float | None = None  # time.monotonic() past which the engine is given up
    # The request body's hash when an Idempotency-Key named the response (its replay check).
    idempotency: str | None = None
    # A stored response outlives its request: called once when it ends (or never runs) with
    # the tokens it used, it settles the key's budget reservation (as generations do).
    on_end: Callable[[int], None] | None = None
    started: float = 0.0
    # The conversation whose items came before the input; it gets this response's items.
    conversation_id: str | None = None
    # The constraint the runner compiles for `engine_request.grammar` (stored responses).
    grammar_spec: GrammarSpec | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.engine_request.prompt_token_ids)

    def end(self, num_tokens: int) -> None:
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end(num_tokens)


class ResponseAdmission:
    def __init__(
        self,
        config: ServeConfig,
        identity: dict[str, Any],
        tokenizer: Any,
        grammar: Any,
        store: Store,
    ) -> None:
        self.config = config
        self.identity = identity
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.store = store
        # The prompt's tail tells whether the template left a `<think>` open.
        from actors.tokenizer_file import load_backend_tokenizer

        self.texts = load_backend_tokenizer(config.model)

    async def admit(self, request: Request, req: ResponseCreate) -> AdmittedResponse:
        principal = principal_of(request)
        if req.model != self.config.model_id:
            raise errors.not_found(
                "model_not_found", f"The model '{errors.echo(req.model)}' does not exist.", "model"
            )
        require_model(principal, req.model)
        items = req.items()
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = await asyncio.to_thread(
                self.store.get_response, principal.tenant, req.previous_response_id
            )
            if previous is None:
                raise response_not_found(req.previous_response_id, "previous_response_id")
            if previous.status in ("queued", "in_progress", "cancelling"):
                raise errors.conflict(
                    "previous_response_in_progress",
                    f"Response '{previous.id}' is still {previous.status}: wait for it to end "
                    "(poll GET /v1/responses/{id}), then send this again.",
                )
            history = previous.data["context"]
        if req.conversation_id is not None:
            history = await conversation_history(self.store, principal.tenant, req.conversation_id)
        context = history + chat_messages(items)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        chat = self._chat_request(req, system + context)
        try:  # the server's and the key's static limits (tools, grammar size), as on chat
            check_request(principal, chat, self.config.limits)
        except errors.APIError as exc:
            raise renamed(exc) from None
        prompt_ids = await self._render(chat)
        check_prompt_tokens(principal, [prompt_ids], "input")
        max_tokens = output_budget(
            req.max_output_tokens,
            default=None,  # the room the context leaves
            caps=server_and_key_caps(
                self.config.limits.max_output_tokens, principal.limits.max_output_tokens
            ),
            context=self.identity["max_model_len"],
            prompt_lengths=[len(prompt_ids)],
            prompt_param="input",
            rules=RESPONSE_RULES,
        )
        if req.store:
            on_end = await reserve_detached(request, principal, len(prompt_ids), max_tokens)
        else:
            on_end = None
            await reserve_budget(request, chat, [prompt_ids], max_tokens)
        params = chat.to_sampling_params(max_tokens)
        tail = self.texts.decode(prompt_ids[-PROMPT_TAIL:], skip_special_tokens=False)
        parse = chat_parse_options(chat, tail)
        try:
            spec = grammar_spec(chat, parse, identity=self.identity, options=self.config.grammar)
        except errors.APIError as exc:
            raise renamed(exc) from None
        # A stored response's grammar is compiled by the runner that runs it (it owns the
        # result, which would die with this replica); a store: false one's here.
        grammar = None
        if spec is not None and not req.store:
            grammar = await compile_grammar(self.grammar, spec)
        timeout_s = client_timeout_s(request, None)
        response_id = new_response_id()
        engine_request = EngineRequest(
            response_id,
            prompt_ids,
            params,
            grammar=grammar,
            timeout_s=timeout_s,
            # The caller's tenant, as authenticated: never a field of the body.
            cache_namespace=prefix_namespace(
                principal.tenant, self.config.engine.shared_prefix_tenants
            ),
        )
        deadline = time.monotonic() + timeout_s + ENGINE_SILENCE_GRACE_S if timeout_s else None
        return AdmittedResponse(
            req=req,
            chat=chat,
            tenant=principal.tenant,
            response_id=response_id,
            created_at=time.time(),
            engine_request=engine_request,
            parse=parse,
            input_items=[listed_item(item) for item in items],
            context=context,
            deadline=deadline,
            started=time.monotonic(),
            on_end=on_end,
            conversation_id=req.conversation_id,
            grammar_spec=spec if req.store else None,
        )

    def _chat_request(self, req: ResponseCreate, messages: list[dict[str, Any]]) -> Any:
        try:
            return parse_request("chat", chat_body(req, messages, req.max_output_tokens))
        except errors.APIError as exc:
            raise renamed(exc) from None

    async def _render(self, chat: ChatCompletionRequest) -> list[int]:
        messages = [m.model_dump(exclude_none=True) for m in chat.messages]
        try:
            return await self.tokenizer.render_chat.remote(
                messages, add_generation_prompt=True, tools=chat.tools
            )
        except errors.APIError as exc:  # the tokenizer deployment's own (Ray wraps it)
            raise renamed(errors.api_error_in(exc) or exc) from None
        except Exception as exc:
            found = errors.api_error_in(exc)
            if found is None:
                raise
            raise renamed(found) from None


async def conversation_history(store: Store, tenant: str, conversation_id: str) -> list[Any]:
    """A conversation's items as the chat turns a response continues: 404
    `conversation_not_found`, 409 `stale_revision` while a generation holds its next turn."""
    history = await read_history(store, tenant, conversation_id, "conversation")
    record = history.conversation
    if record.pending_generation is not None:
        raise stale_revision(record, None)
    return chat_messages(
        [parse_item(item, f"conversation.items.{i}") for i, item in enumerate(record.items)]
    )


def listed_item(item: InputItem) -> dict[str, Any]:
    """An input item as `GET /v1/responses/{id}/input_items` lists it (with an id)."""
    if isinstance(item, MessageItem):
        kind = "output_text" if item.role == "assistant" else "input_text"
        return {
            "id": item.id or new_item_id("msg"),
            "type": "message",
            "role": item.role,
            "status": "completed",
            "content": [{"type": kind, "text": item.text}],
        }
    if isinstance(item, FunctionCallItem):
        return {
            "id": item.id or new_item_id("fc"),
            "type": "function_call",
            "call_id": item.call_id,
            "name": item.name,
            "arguments": item.arguments,
            "status": "completed",
        }
    if isinstance(item, FunctionCallOutputItem):
        return {
            "id": item.id or new_item_id("fco"),
            "type": "function_call_output",
            "call_id": item.call_id,
            "output": item.text,
            "status": "completed",
        }
    assert isinstance(item, ReasoningItem)
    return {
        "id": item.id or new_item_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": item.text}],
        "status": "completed",
    }
