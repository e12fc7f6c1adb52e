"""Admission of a generation: authorization, the profile's rules, the assembled input and its
budgets, the key's limits and reservation. Everything here happens before the resource
exists; every refusal names what fired (422 for token budgets, as the seed chooses)."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from starlette.requests import Request

from actors.sampling_params import SamplingParams
from serve_app import errors
from serve_app.access.budgets import LIMITER_STATE_KEY
from serve_app.access.keys import Principal, principal_of, require_model, require_profile
from serve_app.access.output_budget import BudgetRules, output_budget, server_and_key_caps
from serve_app.access.prefix_scope import prefix_namespace
from serve_app.config.options import ServeConfig
from serve_app.config.profiles import (
    TEXT_FORMAT,
    Profile,
    constrained_schema,
    format_instructions,
)
from serve_app.generations.protocol import GenerationCreate
from serve_app.grammar.spec import GrammarSpec
from serve_app.resources.admitted import AdmittedGeneration
from serve_app.resources.conversations import not_found, read_history
from serve_app.resources.idempotency import key_record
from serve_app.resources.resource import new_generation_id, usage
from serve_app.store.base import ConversationTurn, GenerationRecord, Store

OPERATION = "generations.create"


# The generations API's wording of an output-budget refusal (422, as its seed chooses).
GENERATION_RULES = BudgetRules(
    param="max_output_tokens",
    status=422,
    overflow_code="context_length_exceeded",
    overflow_param="input",
)


class GenerationAdmission:
    def __init__(
        self,
        config: ServeConfig,
        identity: dict[str, Any],
        tokenizer: Any,
        store: Store,
        owner: str,
    ) -> None:
        self.config = config
        self.options = config.generations
        self.identity = identity
        self.tokenizer = tokenizer
        self.store = store
        self.owner = owner

    async def admit(
        self, request: Request, req: GenerationCreate, key: str | None
    ) -> AdmittedGeneration:
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
        history: list[dict[str, Any]] = []
        turn = None
        if req.conversation is not None:
            found = await read_history(
                self.store, principal.tenant, req.conversation.id, "conversation.id"
            )
            history = found.messages
            turn = ConversationTurn(found.conversation.id, req.conversation.expected_revision)
        new_messages = req.input_messages()
        schema = self.options.output_formats.get(output_format)
        messages = self._system(profile, output_format, schema) + history + new_messages
        prompt_ids = await self.tokenizer.render_chat.remote(messages, add_generation_prompt=True)
        self._check_input(profile, len(prompt_ids), principal)
        max_output = output_budget(
            # A profile's default is a fixed number the resource records: checked like a
            # requested one, never lowered to fit.
            req.max_output_tokens or profile.default_max_output_tokens,
            default=None,
            caps=[
                (f"profile '{profile.name}'", profile.max_output_tokens),
                *server_and_key_caps(
                    self.config.limits.max_output_tokens, principal.limits.max_output_tokens
                ),
            ],
            context=self.identity["max_model_len"],
            prompt_lengths=[len(prompt_ids)],
            prompt_param="input",
            rules=GENERATION_RULES,
        )
        plan = self._build_plan(
            principal.tenant, profile, req, model, output_format, prompt_ids, max_output
        )
        plan.turn = turn
        plan.turn_messages = new_messages
        plan.cache_namespace = prefix_namespace(
            principal.tenant, self.config.engine.shared_prefix_tenants
        )
        if key is not None:
            ttl_s = self.options.idempotency_ttl_s
            plan.idempotency = key_record(OPERATION, key, req.body_hash(), ttl_s)
        await self._reserve(request, principal, plan, max_output)
        return plan

    async def _reserve(
        self, request: Request, principal: Principal, plan: AdmittedGeneration, max_output: int
    ) -> None:
        """The key's concurrency and token budgets (429 naming the limit); the reservation
        is settled to measured usage when the generation ends, however it ends."""
        limiter = (request.scope.get("state") or {}).get(LIMITER_STATE_KEY)
        if limiter is None:
            return
        num_input = len(plan.prompt_ids)
        reservation_id = await limiter.reserve_detached(principal, num_input, max_output)
        if reservation_id is not None:
            key_id = principal.key_id

            def settle(tokens: int) -> None:
                limiter.settle_detached(key_id, reservation_id, tokens)

            plan.on_end = settle

    def _build_plan(
        self,
        tenant: str,
        profile: Profile,
        req: GenerationCreate,
        model: str,
        output_format: str,
        prompt_ids: list[int],
        max_output: int,
    ) -> AdmittedGeneration:
        now = time.time()
        schema = self.options.output_formats.get(output_format)
        grammar = None
        if schema is not None:
            grammar = GrammarSpec.json_schema(constrained_schema(schema))
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
            new_generation_id(), tenant, "queued", self.owner, data, now, now, None
        )
        return AdmittedGeneration(
            record=record,
            prompt_ids=prompt_ids,
            params=SamplingParams(
                max_tokens=max_output, temperature=profile.temperature, top_p=profile.top_p
            ),
            grammar=grammar,
            output_format=output_format,
            schema=schema,
            deadline=now + (profile.deadline_s or self.options.deadline_s),
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
                f"Profile '{profile.name}' runs on {', '.join(allowed)}, not "
                f"'{errors.echo(model)}'.",
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

    def _system(
        self, profile: Profile, output_format: str, schema: dict[str, Any] | None
    ) -> list[dict[str, Any]]:
        parts = [profile.instructions] if profile.instructions else []
        if schema is not None:
            parts.append(format_instructions(output_format, schema))
        return [{"role": "system", "content": "\n\n".join(parts)}] if parts else []

    def _check_input(self, profile: Profile, num_input: int, principal: Principal) -> None:
        key_bound = principal.limits.max_prompt_tokens
        if key_bound is not None and num_input > key_bound:
            raise errors.context_length_exceeded(
                f"The assembled input has {num_input} tokens; the API key's limit "
                f"max_prompt_tokens allows at most {key_bound}.",
                status=422,
                param="input",
            )
        budget = profile.input_budget_tokens
        if budget is not None and num_input > budget:
            raise errors.context_length_exceeded(
                f"The assembled input (instructions, history and input) has {num_input} "
                f"tokens; profile '{profile.name}' has an input budget of {budget} tokens.",
                status=422,
                param="input",
            )


def sha256_ids(token_ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()


def conversation_not_found(conversation_id: str) -> errors.APIError:
    return not_found(conversation_id, "conversation.id")
