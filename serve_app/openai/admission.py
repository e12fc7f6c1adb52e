"""Admission for the OpenAI endpoints: context and max_tokens limits, sampling parameters, the
client deadline and the grammar future, all decided before any header is sent. The result is a
`Job`: one validated engine request per prompt."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from actors.messages import EngineRequest
from serve_app.access.budgets import reserve_budget
from serve_app.access.keys import principal_of
from serve_app.access.output_budget import output_budget, server_and_key_caps
from serve_app.access.prefix_scope import prefix_namespace
from serve_app.access.static_limits import check_prompt_tokens
from serve_app.config.options import ServeConfig
from serve_app.openai.format import ChoiceState, Formatter
from serve_app.openai.token_text import TokenTexts
from serve_app.parsers.chat_output import ChoiceParser, ParseOptions
from serve_app.protocol import Usage, new_id
from serve_app.protocol.deadlines import FIELD_PARAM, client_timeout_s, deadline_param
from serve_app.workers.constraint import start_grammar


@dataclass
class AdmittedRequest:
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
    # Chat: how each choice's text is read (reasoning, tool calls); None: verbatim content.
    parse: ParseOptions | None = None
    # Where the client's deadline was set: the `param` of a deadline error.
    deadline_param: str = FIELD_PARAM

    @property
    def num_choices(self) -> int:
        return len(self.engine_requests) * self.n

    @property
    def endpoint(self) -> str:
        return "chat" if self.formatter.chat else "completions"

    def new_choices(self) -> list[ChoiceState]:
        """Fresh per-choice state: parser state belongs to one choice of one request."""
        if self.parse is None or self.parse.is_plain:
            return [ChoiceState(i) for i in range(self.num_choices)]
        return [ChoiceState(i, parser=ChoiceParser(self.parse)) for i in range(self.num_choices)]

    def choice_echo(self) -> list[str]:
        """The echoed prompt of each choice ("" unless the completions request asked)."""
        return [self.echo[c // self.n] for c in range(self.num_choices)]

    def usage(self, choices: list[ChoiceState], cached: list[int]) -> Usage:
        prompt_tokens = sum(len(r.prompt_token_ids) for r in self.engine_requests)
        return Usage.of(prompt_tokens, sum(c.num_tokens for c in choices), sum(cached))


class OpenAIAdmission:
    def __init__(
        self, config: ServeConfig, identity: dict[str, Any], texts: TokenTexts, grammar: Any
    ) -> None:
        self.config = config
        self.identity = identity
        self.max_model_len: int = identity["max_model_len"]
        self.texts = texts
        self.grammar = grammar

    async def admit(
        self,
        req: Any,
        prompts: list[list[int]],
        prompt_param: str,
        *,
        chat: bool,
        echo: list[str],
        request: Request,
        parse: ParseOptions | None = None,
    ) -> AdmittedRequest:
        principal = principal_of(request)
        check_prompt_tokens(principal, prompts, prompt_param)
        max_tokens = output_budget(
            req.requested_max_tokens(),
            default=None,  # OpenAI's default: the room the context leaves
            caps=server_and_key_caps(
                self.config.limits.max_output_tokens, principal.limits.max_output_tokens
            ),
            context=self.max_model_len,
            prompt_lengths=[len(ids) for ids in prompts],
            prompt_param=prompt_param,
        )
        await reserve_budget(request, req, prompts, max_tokens)
        req.check_common(max_tokens)
        params = req.to_sampling_params(max_tokens)
        grammar = await self.start_grammar(req, parse)
        formatter = Formatter(
            chat=chat,
            response_id=new_id("chatcmpl" if chat else "cmpl"),
            model=self.config.model_id,
            fingerprint=self.identity["fingerprint"],
            texts=self.texts,
            want_logprobs=params.logprobs is not None,
            want_token_ids=bool(req.return_token_ids),
            prompt_ids=prompts,
            n=params.n,
            prompt_top=req.prompt_logprobs,
            echo_top=req.logprobs if getattr(req, "echoes_logprobs", False) else None,
        )
        timeout_s = client_timeout_s(request, req)
        # The caller's tenant, as authenticated: never a field of the body.
        namespace = prefix_namespace(principal.tenant, self.config.engine.shared_prefix_tenants)
        engine_requests = [
            EngineRequest(
                uuid.uuid4().hex,
                ids,
                params,
                grammar=grammar,
                timeout_s=timeout_s,
                cache_namespace=namespace,
            )
            for ids in prompts
        ]
        # The engine enforces the deadline; this one only guards against a lost engine.
        deadline = time.monotonic() + timeout_s + 5.0 if timeout_s else None
        job = AdmittedRequest(
            req, formatter, engine_requests, echo, params.n, deadline, parse=parse
        )
        job.started = time.monotonic()
        job.deadline_param = deadline_param(request, req)
        return job

    async def start_grammar(self, req: Any, parse: ParseOptions | None) -> list[object] | None:
        return await start_grammar(
            req, parse, identity=self.identity, options=self.config.grammar, compiler=self.grammar
        )
