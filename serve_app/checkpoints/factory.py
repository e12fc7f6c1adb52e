"""Build small local Hugging Face-format checkpoints with seeded random weights.

Tests, demos and benchmarks need real checkpoints (config, safetensors, tokenizer, chat
template) without downloading anything. The weights are random, so the text is gibberish, but
every file is what `transformers` expects, and the same seed gives byte-identical files.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

import torch
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.utils import logging as hf_logging

from serve_app.checkpoints.factory_template import CHAT_TEMPLATE
from serve_app.checkpoints.presets import ARCHS, LLAMA3_ROPE_SCALING, PRESET_SPECS, PRESETS, Preset

MAX_SEED = 2**63 - 1

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Control tokens: skipped by decode(skip_special_tokens=True). They take ids 0..4 in this order.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
# Markup tokens: single ids but not special, so tool calls and reasoning survive a decode that
# skips special tokens (as in Qwen's tokenizers). They take the last ids of the vocabulary.
MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>")

# Every file make_model writes; a directory holding nothing else is a checkpoint we may replace.
CHECKPOINT_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "special_tokens_map.json",
    }
)
VOCAB_MULTIPLE = 64
# Copied from transformers' Qwen2Tokenizer, which AutoTokenizer forces on qwen2 checkpoints.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NORM_WEIGHT_STD = 0.1
BIAS_STD = 0.2

_MODEL_CLASSES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def make_model(
    out_dir: str | os.PathLike[str],
    arch: str = "llama",
    preset: str = "tiny",
    seed: int = 0,
    *,
    force: bool = False,
) -> Path:
    """Write a checkpoint to `out_dir` and return its path.

    An existing `out_dir` is replaced only when it is empty, holds nothing but files this
    function writes, or `force` is set; otherwise FileExistsError. Bad arguments: ValueError.
    """
    validate_args(arch, preset, seed)
    out = Path(out_dir).expanduser().absolute()
    _check_replaceable(out, force)
    return swap_in_folder(
        out, lambda staging: _write_checkpoint(staging, arch, PRESET_SPECS[preset], seed)
    )


def swap_in_folder(out: Path, fill: Callable[[Path], object]) -> Path:
    """`fill` a folder built beside `out`, then swap it in: an interrupted run never leaves
    half a checkpoint."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide an ordinary checkpoint from others
    try:
        fill(staging)
        if out.is_dir():
            shutil.rmtree(out)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def validate_args(arch: str, preset: str, seed: int) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an integer in [0, 2**63 - 1], got {seed!r}")


def _check_replaceable(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if force or not out.is_dir():
        return
    unknown = sorted(p.name for p in out.iterdir() if p.name not in CHECKPOINT_FILES)
    if unknown:
        shown = ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        raise FileExistsError(
            f"{out} is not empty and is not a checkpoint made by make-model "
            f"(found {shown}); choose another directory or pass --force to replace it"
        )


def _write_checkpoint(out: Path, arch: str, spec: Preset, seed: int) -> None:
    tokenizer = build_tokenizer(arch, spec.vocab_size, spec.max_position_embeddings)
    config = build_config(arch, spec, num_tokens=len(tokenizer))
    model = build_model(config, seed, spec.initializer_range)
    with _progress_bars_off():
        model.save_pretrained(out, safe_serialization=True)
    _save_tokenizer(tokenizer, out, arch)


@contextmanager
def _progress_bars_off() -> Iterator[None]:
    # A one-shard save still draws a bar on stderr, which buries the CLI's own messages.
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# ---------------------------------------------------------------- tokenizer


def corpus_texts() -> list[str]:
    """The packaged training corpus (prose, JSON, code, chat transcripts), in a fixed order."""
    corpus = resources.files("serve_app.checkpoints").joinpath("corpus")
    names = sorted(p.name for p in corpus.iterdir() if p.name.endswith(".txt"))
    return [corpus.joinpath(name).read_text(encoding="utf-8") for name in names]


def _training_texts(texts: list[str]) -> Iterator[str]:
    # Marker strings become added tokens; learning merges for their pieces would waste vocab.
    for marker in SPECIAL_TOKENS + MARKUP_TOKENS:
        texts = [t.replace(marker, "") for t in texts]
    # BPE ranks merges by count, so repeating the corpus keeps its own merges first; the case
    # variants add distinct words, which the 8k vocabulary needs on a corpus this small.
    for _ in range(3):
        yield from texts
    for text in texts:
        yield text.upper()
        yield text.title()


def build_tokenizer(arch: str, vocab_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE that adds no BOS; any text survives encode -> decode (NFC text for qwen2)."""
    tokenizer = Tokenizer(models.BPE())
    _set_byte_level_pipeline(tokenizer, arch)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKUP_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_texts(corpus_texts()), trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    if [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] != list(special_token_ids().values()):
        raise RuntimeError("tokenizers did not place the special tokens at ids 0..4")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )


def _set_byte_level_pipeline(tokenizer: Tokenizer, arch: str) -> None:
    tokenizer.decoder = decoders.ByteLevel()
    if arch != "qwen2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        return
    # NOTE: AutoTokenizer loads every qwen2 checkpoint as Qwen2Tokenizer, which keeps the vocab
    # and merges but rebuilds this pipeline in code. Training with the same pipeline keeps
    # tokenizer.json and AutoTokenizer in agreement (NFC also means non-NFC input, such as
    # a decomposed accent, comes back composed, as with real Qwen2 checkpoints).
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _save_tokenizer(tokenizer: PreTrainedTokenizerFast, out: Path, arch: str) -> None:
    tokenizer.save_pretrained(out)
    # Without an explicit null, Qwen2Tokenizer invents an `<|endoftext|>` unk token one id past
    # the vocabulary. Naming the class that really loads keeps the file honest.
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["unk_token"] = None
    if arch == "qwen2":
        config["tokenizer_class"] = "Qwen2Tokenizer"
    path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------- model


def padded_vocab_size(num_tokens: int) -> int:
    return math.ceil(num_tokens / VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def special_token_ids() -> dict[str, int]:
    """Ids are fixed by construction: control tokens first, in SPECIAL_TOKENS order."""
    return {token: i for i, token in enumerate(SPECIAL_TOKENS)}


def build_config(arch: str, spec: Preset, num_tokens: int) -> PretrainedConfig:
    ids = special_token_ids()
    rope: dict[str, float | int | str] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    extra: dict[str, object] = {}
    if arch == "llama" and spec.llama_rope_scaled:
        rope = {**LLAMA3_ROPE_SCALING, "rope_theta": spec.rope_theta}
    if arch == "qwen2":
        extra["use_sliding_window"] = False
    if arch == "mistral":
        extra["sliding_window"] = spec.mistral_sliding_window
    config_class, _ = _MODEL_CLASSES[arch]
    return config_class(
        vocab_size=padded_vocab_size(num_tokens),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        initializer_range=spec.initializer_range,
        rope_parameters=rope,
        # A tied Qwen2 has no lm_head tensor on disk; loaders must reuse the embedding.
        tie_word_embeddings=arch == "qwen2" and spec.qwen2_tied_embeddings,
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
        pad_token_id=ids[PAD_TOKEN],
        dtype=torch.float32,
        **extra,
    )


def build_model(config: PretrainedConfig, seed: int, init_std: float) -> PreTrainedModel:
    _, model_class = _MODEL_CLASSES[config.model_type]
    # Seeding the global RNG for transformers' own init must not reset the caller's stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32).eval()
    _init_weights(model, seed, init_std)
    ids = special_token_ids()
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=[ids[EOS_TOKEN], ids[IM_END_TOKEN]],
        pad_token_id=ids[PAD_TOKEN],
    )
    return model


@torch.no_grad()
def _init_weights(model: PreTrainedModel, seed: int, init_std: float) -> None:
    # Own init instead of transformers' so weights depend only on (seed, parameter order), and
    # so norms and biases are random too: a bug that drops a norm weight or a qkv bias must
    # change the output. Tied parameters appear once in named_parameters().
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        if param.ndim >= 2:
            param.copy_(noise * init_std)
        elif name.endswith(".bias"):
            param.copy_(noise * BIAS_STD)
        else:  # RMSNorm scale
            param.copy_(1.0 + noise * NORM_WEIGHT_STD)
