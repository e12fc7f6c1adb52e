"""Grammar helpers for the tests: compile a spec on the service, check what a compiled grammar
admits on the engine-side cache. (The `model_path`, `service` and `engine_cache` fixtures are in
tests/conftest.py.)"""

from __future__ import annotations

import asyncio

from actors.grammar_cache import CompiledGrammarCache
from serve_app.grammar.service import CompiledGrammarPayload, GrammarService
from serve_app.grammar.spec import GrammarSpec


def compile_spec(service: GrammarService, kind: str, spec: str = "") -> CompiledGrammarPayload:
    return asyncio.run(service.compile(GrammarSpec(kind, spec)))


def accepts(
    cache: CompiledGrammarCache, payload: CompiledGrammarPayload, text: str | bytes
) -> bool:
    """Whether the grammar admits exactly `text` as a complete output."""
    matcher = cache.get_constraint(payload).matcher
    return matcher.accept_string(text) and matcher.is_completed()


def accepts_tokens(
    cache: CompiledGrammarCache, payload: CompiledGrammarPayload, token_ids: list[int]
) -> bool:
    """Whether a fresh matcher accepts `token_ids` one at a time and ends where the grammar
    does: terminated (its stop token accepted) or with nothing left but the end."""
    matcher = cache.get_constraint(payload).matcher
    if not all(matcher.accept_token(t) for t in token_ids):
        return False
    return matcher.is_terminated() or matcher.is_completed()
