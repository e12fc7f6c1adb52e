"""GGUF files as ordinary checkpoints: dequantized once, through transformers' GGUF reader, into
a Hugging Face folder cached under the file's sha256, then loaded like any local checkpoint.

The folder is a plain fp32 checkpoint that other engines load too: `architectures` set, no
`quantization_config` (vLLM refuses a config naming `gguf`), the tokenizer, chat template and
generation config taken from the GGUF metadata, and `gguf_source.json` recording where it came
from (the served identity reports it). It is built in a temporary folder and renamed into place,
so a killed conversion never leaves a half folder that a later start would load.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

GGUF_SUFFIX = ".gguf"
# Where converted folders live: $SERVE_APP_GGUF_CACHE, else $SERVE_APP_CACHE/gguf, else
# ~/.cache/serve-app/gguf.
CACHE_ENV = "SERVE_APP_GGUF_CACHE"
SOURCE_FILE = "gguf_source.json"
# GGUF `general.architecture` values our engine runs (llama.cpp writes Mistral as "llama";
# transformers tells them apart by name and reports `model_type: mistral`).
GGUF_ARCHITECTURES = ("llama", "qwen2")
# transformers' `model_type` after loading -> the architecture written into config.json.
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


class GGUFError(ValueError):
    """A GGUF file this engine cannot load (architecture, quantization type, not a GGUF)."""


@dataclass(frozen=True)
class GGUFSource:
    """What a converted folder was made from; stored beside it as `gguf_source.json`."""

    gguf_file: str
    gguf_sha256: str
    gguf_quant_type: str
    gguf_architecture: str
    architecture: str
    converted_with: str


def is_gguf_path(model: str | os.PathLike[str]) -> bool:
    return str(model).lower().endswith(GGUF_SUFFIX)


def resolve_checkpoint(model: str | os.PathLike[str]) -> str:
    """A checkpoint folder for `model`: a GGUF file becomes its cached converted folder
    (converted on first use), anything else is returned as given."""
    if not is_gguf_path(model):
        return str(model)
    return str(gguf_checkpoint(model))


def cache_root() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("SERVE_APP_CACHE") or Path.home() / ".cache" / "serve-app"
    return Path(base).expanduser() / "gguf"


def gguf_checkpoint(path: str | os.PathLike[str], root: Path | None = None) -> Path:
    """The converted folder of the GGUF file at `path`, building it when it is not cached."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise GGUFError(f"model: {path} does not exist (expected a .gguf file)")
    root = root or cache_root()
    sha = file_sha256(path, root)
    final = root / sha
    if (final / SOURCE_FILE).is_file():
        return final
    source = inspect_gguf(path, sha)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{sha[:16]}-", dir=root))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide an ordinary checkpoint from others
    try:
        print(
            f"converting {path.name} ({source.gguf_quant_type}, {source.architecture}) to an "
            f"fp32 checkpoint in {final} (once per file)",
            file=sys.stderr,
            flush=True,
        )
        _convert(path, source, staging)
        if final.exists() and not (final / SOURCE_FILE).is_file():
            shutil.rmtree(final, ignore_errors=True)  # a stale folder from an older layout
        os.replace(staging, final)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        # Another process renamed its own finished copy into place first: theirs serves.
        if not (final / SOURCE_FILE).is_file():
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def read_source(model_dir: str | os.PathLike[str]) -> GGUFSource | None:
    """The GGUF provenance of a checkpoint folder, or None for one not made from a GGUF."""
    record = Path(model_dir) / SOURCE_FILE
    if not record.is_file():
        return None
    return GGUFSource(**json.loads(record.read_text()))


def file_sha256(path: Path, root: Path) -> str:
    """sha256 of the file's bytes, memoised by path, size and mtime (a GGUF may be GBs)."""
    stat = path.stat()
    stamp = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    memo = root / "sha256" / (hashlib.sha256(stamp.encode()).hexdigest() + ".txt")
    if memo.is_file():
        return memo.read_text().strip()
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(digest)
    except OSError:
        pass  # a read-only cache only costs a re-hash next time
    return digest


def inspect_gguf(path: Path, sha: str) -> GGUFSource:
    """Read the metadata and check, before any dequantization, that this file can be served."""
    from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType

    # The gguf package's own table of the types it can dequantize (besides F32 and F16).
    from gguf.quants import _type_traits

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise GGUFError(f"model: {path.name} is not a readable GGUF file ({exc})") from None
    arch = _field(reader, "general.architecture") or "?"
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(
            f"model: {path.name} has GGUF architecture {arch!r}, which this engine does not "
            f"serve; supported: {', '.join(GGUF_ARCHITECTURES)} (llama includes Mistral)"
        )
    dequantizable = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
    unsupported = sorted({t.tensor_type.name for t in reader.tensors} - _names(dequantizable))
    if unsupported:
        raise GGUFError(
            f"model: {path.name} holds tensors of quantization type {', '.join(unsupported)}, "
            "which cannot be dequantized here; supported: "
            + ", ".join(sorted(_names(dequantizable)))
        )
    file_type = _field(reader, "general.file_type")
    if file_type is not None:
        quant = LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    else:
        counts = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
        quant = counts.most_common(1)[0][0] if counts else "F32"
    name = str(_field(reader, "general.name") or "").lower()
    model_type = "mistral" if arch == "llama" and "mistral" in name else arch
    return GGUFSource(
        gguf_file=path.name,
        gguf_sha256=sha,
        gguf_quant_type=quant,
        gguf_architecture=arch,
        architecture=HF_ARCHITECTURES[model_type],
        converted_with=_converter_versions(),
    )


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _names(types) -> set[str]:
    return {t.name for t in types}


def _converter_versions() -> str:
    from importlib.metadata import version

    return f"transformers {version('transformers')}, gguf {version('gguf')}"


def _convert(path: Path, source: GGUFSource, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    with _quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    if HF_ARCHITECTURES.get(model.config.model_type) != source.architecture:
        raise GGUFError(
            f"model: transformers read {name} as {model.config.model_type!r}, expected "
            f"{source.architecture}"
        )
    tied = bool(model.config.tie_word_embeddings)
    # NOTE: `save_pretrained` refuses a GGUF-loaded model; the state dict saves fine, minus
    # the tied head (it shares the embedding's storage, which safetensors rejects).
    state = {
        key: tensor.contiguous()
        for key, tensor in model.state_dict().items()
        if not (tied and key == "lm_head.weight")
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [source.architecture]
    model.config.save_pretrained(out)
    _drop_quantization_config(out / "config.json")
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # Written last: its presence is what marks a finished folder.
    (out / SOURCE_FILE).write_text(json.dumps(asdict(source), indent=2) + "\n")


def _drop_quantization_config(config_file: Path) -> None:
    """The weights are plain fp32 now; a config still naming `gguf` makes vLLM refuse it."""
    config = json.loads(config_file.read_text())
    config.pop("quantization_config", None)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No tqdm bar and no info lines while dequantizing: the one line above says it all."""
    from functools import partial

    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    # NOTE: the GGUF reader draws its bar with tqdm directly, past transformers' own switch.
    reader_bar = gguf_utils.tqdm
    gguf_utils.tqdm = partial(reader_bar, disable=True)
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        gguf_utils.tqdm = reader_bar
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
