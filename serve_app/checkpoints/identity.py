"""The served artifact's identity: hashes of weights, tokenizer and chat template, and of the
GGUF file a converted checkpoint came from.

Two deployments with the same weights and a different template are different artifacts, so
every answer names all of them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from actors.models.gguf import read_source

CACHE_DIR = Path(os.environ.get("SERVE_APP_CACHE", Path.home() / ".cache" / "serve-app"))


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def weights_hash(model_dir: str | Path) -> str:
    """sha256 over every safetensors file (name + content), memoised by size and mtime."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    stamp = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    memo = CACHE_DIR / "hashes" / (hashlib.sha256(repr(stamp).encode()).hexdigest() + ".txt")
    if memo.is_file():
        return memo.read_text().strip()
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(_sha256_file(f).encode())
    digest = h.hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(digest)
    except OSError:
        pass  # a read-only home only costs a re-hash next time
    return digest


def tokenizer_hash(model_dir: str | Path) -> str:
    """sha256 of tokenizer.json; tokenizers without one hash their vocabulary files."""
    model_dir = Path(model_dir)
    primary = model_dir / "tokenizer.json"
    files = [primary] if primary.is_file() else sorted(model_dir.glob("*token*"))
    return hashlib.sha256(b"".join(f.read_bytes() for f in files if f.is_file())).hexdigest()


def artifact_identity(
    model_dir: str | Path, chat_template: str | None, extra: dict | None = None
) -> dict:
    """Hashes of what is served plus `extra` (grammar backend, parsers); `fingerprint`
    digests all of it."""
    model_dir = Path(model_dir)
    identity = {
        "weights_sha256": weights_hash(model_dir),
        "tokenizer_sha256": tokenizer_hash(model_dir),
        "chat_template_sha256": hashlib.sha256((chat_template or "").encode()).hexdigest(),
    }
    source = read_source(model_dir)
    if source is not None:  # a folder converted from a GGUF file: name the file too
        identity.update(gguf_sha256=source.gguf_sha256, gguf_quant_type=source.gguf_quant_type)
    identity.update(extra or {})
    identity["fingerprint"] = (
        "fp_"
        + hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[
            :16
        ]
    )
    return identity
