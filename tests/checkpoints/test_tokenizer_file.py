"""`load_tokenizer` gives the tokenizer `AutoTokenizer` gives, and for a Llama folder that
declares the generic fast class it does so without importing torch (the tokenizer replica's
start and memory).

Compared on what a client sees: the vocabulary, the special tokens, encodings of text that
spells control tokens, decoding, and the chat template's rendering."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from actors.tokenizer_file import load_tokenizer, loads_directly
from tests.support.fresh_python import run_python

TEXTS = [
    "Hello, world! Ünïcödé ✓ 数字 123",
    "<|im_start|>user\nhi<|im_end|>",
    "  leading spaces and\ttabs\n\nnew lines",
    "<s> </s> <unk>",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And <|im_end|> 3 + 3?"},
]


def same_tokenizer(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        theirs.bos_token,
        theirs.eos_token,
        theirs.pad_token,
        theirs.unk_token,
    )
    assert ours.chat_template == theirs.chat_template
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False
        )
        assert ours.decode(ids) == theirs.decode(ids)
    if theirs.chat_template is not None:
        for prompt in (True, False):
            assert ours.apply_chat_template(
                CHAT, tokenize=False, add_generation_prompt=prompt
            ) == theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt)


def llama3_style(tiny: Path, dest: Path) -> Path:
    """The tiny llama declaring `PreTrainedTokenizerFast`, as Llama 3 checkpoints do."""
    shutil.copytree(tiny, dest)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize("kind", ["tiny", "llama3_style", "trained"])
def test_a_llama_folder_of_the_generic_class_loads_directly_as_autotokenizer_would(
    kind, model_dirs, tmp_path, request
):
    if kind == "trained":
        folder = request.getfixturevalue("trained_dir")
    elif kind == "tiny":
        folder = model_dirs("llama")
    else:
        folder = llama3_style(model_dirs("llama"), tmp_path / "llama3")
    assert loads_directly(folder)
    same_tokenizer(load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder)))


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_families_go_through_autotokenizer(arch, model_dirs):
    folder = model_dirs(arch)
    assert not loads_directly(folder)
    same_tokenizer(load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder)))


def test_a_model_specific_or_remote_class_goes_through_autotokenizer(model_dirs, tmp_path):
    folder = shutil.copytree(model_dirs("llama"), tmp_path / "remote")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**config, "auto_map": {"AutoTokenizer": [None, "tok.MyTokenizer"]}})
    )
    assert not loads_directly(folder)
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": "LlamaTokenizer"})
    )
    assert not loads_directly(folder)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert not loads_directly(folder)


def test_the_tokenizer_replica_loads_its_tokenizer_without_torch(model_dirs):
    """What the tokenizer deployment runs at start, in a fresh process."""
    code = (
        "import sys\n"
        "from serve_app.workers.tokenizer import TokenizerService\n"
        f"service = TokenizerService({str(model_dirs('llama'))!r})\n"
        "ids = service.render_chat([{'role': 'user', 'content': 'hi'}])\n"
        "assert ids, ids\n"
        "print('torch' in sys.modules)\n"
    )
    assert run_python(code) == "False", "the tokenizer replica imported torch"
