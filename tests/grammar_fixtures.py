"""Shared fixtures for the grammar tests: the service, the engine-side cache, helpers."""

from __future__ import annotations

import asyncio

import pytest

from actors.grammar_cache import CompiledGrammarCache, load_tokenizer_info
from serve_app.grammar.service import CompiledGrammarPayload, GrammarService
from serve_app.grammar.spec import GrammarSpec


@pytest.fixture(scope="session")
def model_path(model_dirs) -> str:
    return str(model_dirs("llama"))


@pytest.fixture(scope="session")
def service(model_path):
    # One per run: its compile workers start once (a test that changes it restores it).
    svc = GrammarService(model_path)
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def engine_cache(model_path) -> CompiledGrammarCache:
    return CompiledGrammarCache(lambda: load_tokenizer_info(model_path))


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
