"""Grammar helpers for the tests: compile a spec on the service, check what a compiled grammar
admits on the engine-side cache, read a token bitmask bit by bit. (The `model_path`, `service`
and `engine_cache` fixtures are in tests/conftest.py.)"""

from __future__ import annotations

import asyncio

import torch

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


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, vocab) bools from an xgrammar bitmask (bit t % 32 of word t // 32), read bit by
    bit as the reference for the engine's masks; tokens past the bitmask's width are allowed."""
    bits = (bitmask.long().unsqueeze(-1) >> torch.arange(32)) & 1  # (rows, words, 32)
    allowed = bits.flatten(1).bool()[:, :vocab]
    pad = vocab - allowed.shape[1]
    return torch.cat([allowed, torch.ones(allowed.shape[0], max(pad, 0), dtype=torch.bool)], 1)


def masked_by_bits(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """A copy of `logits` with each listed row's forbidden tokens at -inf (not xgrammar's CPU
    mask: on a vocab that is not a multiple of 32 it can write past the row)."""
    forbidden = ~allowed_tokens(bitmask, logits.shape[1])
    masked = logits.clone()
    for r in rows:
        masked[r] = masked[r].masked_fill(forbidden[r], float("-inf"))
    return masked
