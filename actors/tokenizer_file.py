"""A checkpoint's tokenizer as a `tokenizers.Tokenizer`, read from its `tokenizer.json`.

What decoding and token texts need, without transformers: `AutoTokenizer.from_pretrained`
costs about 4 s of CPU in a fresh process (it imports transformers' model modules), paid by
every engine replica and ingress at start. A checkpoint with only a slow tokenizer falls back to
AutoTokenizer's fast conversion.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


def load_backend_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    from transformers import AutoTokenizer  # a slow tokenizer only: this imports torch

    return AutoTokenizer.from_pretrained(str(model_dir)).backend_tokenizer
