"""A checkpoint's tokenizer, loaded without the imports `AutoTokenizer` pays for.

`AutoTokenizer.from_pretrained` imports transformers' configuration and model modules (and
with them torch) to choose a tokenizer class: about 3 s of CPU in a fresh process, and torch's
memory for the life of the process. Every replica that loads a tokenizer paid it at start.

- `load_backend_tokenizer`: the `tokenizers.Tokenizer` in `tokenizer.json`, which is all that
  decoding and token texts need (engine replicas, the ingress).
- `load_tokenizer`: the transformers tokenizer (chat templates, special tokens) that
  `AutoTokenizer` would give. A Llama folder that declares the generic fast class
  (`TokenizersBackend`, or `PreTrainedTokenizerFast` as Llama 3's do) and ships
  `tokenizer.json` gets that class straight: the class AutoTokenizer picks for it, built from
  the same files. Anything else (Mistral and Qwen2 folders, whose tokenizer class
  AutoTokenizer may replace; a model-specific or remote class; a slow tokenizer only) goes
  through AutoTokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

# The generic fast classes a tokenizer_config.json may name (transformers 5 calls the second
# an alias of the first).
GENERIC_FAST_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
# config.json model types for which AutoTokenizer keeps a generic declared class as it is.
DIRECT_MODEL_TYPES = frozenset({"llama"})


def load_backend_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    return load_tokenizer(model_dir).backend_tokenizer  # a slow tokenizer only: converted


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def loads_directly(model_dir: str | Path) -> bool:
    """Whether `load_tokenizer` builds this folder's tokenizer without AutoTokenizer."""
    folder = Path(model_dir)
    declared = _json(folder / "tokenizer_config.json")
    return (
        (folder / "tokenizer.json").is_file()
        and declared.get("tokenizer_class") in GENERIC_FAST_CLASSES
        and "auto_map" not in declared
        and _json(folder / "config.json").get("model_type") in DIRECT_MODEL_TYPES
    )


def load_tokenizer(model_dir: str | Path):
    """The transformers tokenizer of a checkpoint folder, as `AutoTokenizer` loads it."""
    if loads_directly(model_dir):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer  # imports torch

    return AutoTokenizer.from_pretrained(str(model_dir))
