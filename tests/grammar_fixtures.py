"""Shared fixtures for the grammar tests: the service, the engine-side cache, helpers."""

from __future__ import annotations

import asyncio

import pytest

from actors.grammar_cache import CompiledGrammarCache, load_tokenizer_info
from serve_app.grammar import CompiledGrammarPayload, GrammarService, GrammarSpec


@pytest.fixture(scope="module")
def model_path(model_dirs) -> str:
    return str(model_dirs("llama"))


@pytest.fixture(scope="module")
def service(model_path):
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
