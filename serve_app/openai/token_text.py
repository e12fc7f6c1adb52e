"""Token ids -> the text and exact bytes each token stands for (for logprobs).

Read with the `tokenizers` library from the checkpoint's `tokenizer.json`
(actors/tokenizer_file.py): the ingress never imports transformers (which imports torch).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from actors.tokenizer_file import load_backend_tokenizer


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2's reversible byte <-> printable-character table, used by byte-level BPE.
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenTexts:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        decoder = _byte_decoder()
        if piece is not None and all(c in decoder for c in piece):
            raw = bytes(decoder[c] for c in piece)
        else:
            raw = self.tokenizer.decode([token_id]).encode()
        text = raw.decode("utf-8", errors="replace")
        self._cache[token_id] = (text, raw)
        return text, raw


class _FastTokenizer:
    """The two calls TokenTexts makes, on a `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)


def load_token_texts(model_dir: str | Path) -> TokenTexts:
    return TokenTexts(_FastTokenizer(load_backend_tokenizer(model_dir)))
