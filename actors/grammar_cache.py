"""Engine-side rebuild of compiled grammars shipped by the grammar service.

`xgrammar.CompiledGrammar` cannot be pickled, so the service ships `serialize_json()` text
under a content key. The engine rebuilds each key once against its own tokenizer info and
hands every sample a fresh matcher: matchers hold per-sequence state, compiled grammars don't.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import xgrammar as xgr

from actors.grammar_state import GrammarConstraint

TokenizerInfoSource = xgr.TokenizerInfo | Callable[[], xgr.TokenizerInfo]


class CompiledGrammarLike(Protocol):
    """What the engine needs from the service's payload (kept duck-typed: no serve imports)."""

    @property
    def key(self) -> str: ...

    @property
    def serialized(self) -> str: ...


def load_tokenizer_info(model_path: str | Path) -> xgr.TokenizerInfo:
    """Tokenizer info for the grammar service and the engine alike: the mask width is
    config.json's `vocab_size` (the logits width), which may exceed the tokenizer's own length.
    The stop tokens are the ids the engine stops on: xgrammar would otherwise take a chat
    end-of-turn token (ChatML `<|im_end|>`) for text and admit it mid-value, where the engine
    would end the output half-written."""
    from actors.config import _eos_token_ids
    from actors.tokenizer_file import load_tokenizer

    path = Path(model_path)
    raw = json.loads((path / "config.json").read_text())
    tokenizer = load_tokenizer(path)
    stop_ids = list(_eos_token_ids(path, raw)) or None  # None: xgrammar detects them
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=raw["vocab_size"], stop_token_ids=stop_ids
    )


class CompiledGrammarCache:
    """LRU of rebuilt `CompiledGrammar`s by payload key; thread-safe (the step loop and the
    request handlers may both call it)."""

    def __init__(self, tokenizer_info: TokenizerInfoSource, max_entries: int = 256):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self._info_source = tokenizer_info
        self._info: xgr.TokenizerInfo | None = (
            tokenizer_info if isinstance(tokenizer_info, xgr.TokenizerInfo) else None
        )
        self.max_entries = max_entries
        self._entries: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0

    @property
    def tokenizer_info(self) -> xgr.TokenizerInfo:
        # Built lazily so an engine that never sees a grammar never loads the tokenizer.
        with self._lock:
            if self._info is None:
                assert callable(self._info_source)
                self._info = self._info_source()
            return self._info

    def __len__(self) -> int:
        return len(self._entries)

    def get_compiled(self, payload: CompiledGrammarLike) -> xgr.CompiledGrammar:
        with self._lock:
            compiled = self._entries.get(payload.key)
            if compiled is not None:
                self._entries.move_to_end(payload.key)
                self.num_hits += 1
                return compiled
        # Rebuilt outside the lock: a duplicate rebuild of one key is harmless, a stalled
        # step loop is not.
        try:
            compiled = xgr.CompiledGrammar.deserialize_json(payload.serialized, self.tokenizer_info)
        except RuntimeError as exc:
            # e.g. the service compiled for another tokenizer or vocab size.
            raise ValueError(f"cannot rebuild compiled grammar {payload.key[:12]}: {exc}") from exc
        with self._lock:
            self.num_misses += 1
            self._entries[payload.key] = compiled
            self._entries.move_to_end(payload.key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return compiled

    def get_constraint(self, payload: CompiledGrammarLike) -> GrammarConstraint:
        """A new constraint (its own matcher) per call: one per sample of a request."""
        return GrammarConstraint(self.get_compiled(payload))
