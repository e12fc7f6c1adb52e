from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from serve_app import cli
from serve_app.checkpoints.factory import (
    CHECKPOINT_FILES,
    MARKUP_TOKENS,
    SPECIAL_TOKENS,
    make_model,
)
from serve_app.checkpoints.presets import ARCHS, PRESET_SPECS, PRESETS

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [
    "The lighthouse on the northern cape was built in 1871.",
    'def add(a, b):\n    return {"sum": a + b, "ok": true}',
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather — for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

Loaded = tuple[PreTrainedModel, object]


@pytest.fixture(scope="module")
def load(model_dirs: Callable[..., Path]) -> Callable[..., Loaded]:
    cache: dict[tuple[str, str], Loaded] = {}

    def get(arch: str, preset: str = "tiny") -> Loaded:
        if (arch, preset) not in cache:
            path = model_dirs(arch, preset)
            model = AutoModelForCausalLM.from_pretrained(path).eval()
            cache[arch, preset] = (model, AutoTokenizer.from_pretrained(path))
        return cache[arch, preset]

    return get


@pytest.fixture(scope="module", params=ARCHS)
def tokenizer(request: pytest.FixtureRequest, load: Callable[..., Loaded]):
    return load(request.param)[1]


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


# ---------------------------------------------------------------- checkpoints load and run


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_loads_and_runs(load, model_dirs, arch: str, preset: str) -> None:
    model, tok = load(arch, preset)
    spec = PRESET_SPECS[preset]
    assert sorted(p.name for p in model_dirs(arch, preset).iterdir()) == sorted(
        CHECKPOINT_FILES - {"special_tokens_map.json"}
    )
    assert model.config.model_type == arch
    assert model.dtype == torch.float32
    assert model.config.num_hidden_layers == spec.num_hidden_layers
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    # The corpus is big enough that the trainer reaches the target vocabulary exactly.
    assert len(tok) == spec.vocab_size
    assert model.config.vocab_size >= len(tok) and model.config.vocab_size % 64 == 0
    ids = tok(PROMPTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_top1_has_a_clear_margin(load, arch: str) -> None:
    # Parity tests compare greedy tokens; near-ties would flip under fp32 rounding noise.
    model, tok = load(arch)
    gaps = []
    for prompt in PROMPTS:
        with torch.no_grad():
            logits = model(tok(prompt, return_tensors="pt").input_ids).logits[0]
        top2 = logits.topk(2, dim=-1).values
        gaps.append((top2[:, 0] - top2[:, 1]) / top2[:, 0].abs())
        assert logits.std(dim=-1).min() > 0.5
    assert torch.cat(gaps).median() > 1e-2


def test_qwen2_bias_tied_embeddings_and_norms_are_real(load, model_dirs) -> None:
    model, _ = load("qwen2")
    attn = model.model.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.bias is not None and proj.bias.abs().mean() > 0.05
    assert _config(model_dirs("qwen2"))["tie_word_embeddings"] is True
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with safe_open(model_dirs("qwen2") / "model.safetensors", "pt") as f:
        stored = set(f.keys())
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored
    assert _config(model_dirs("qwen2", "bench"))["tie_word_embeddings"] is False
    # A loader that skips a norm weight must change the output, so norms are not all ones.
    norm = model.model.layers[0].input_layernorm.weight
    assert 0.9 < norm.mean() < 1.1 and norm.std() > 0.05


def test_llama_tiny_uses_llama3_rope_scaling(model_dirs) -> None:
    rope = _config(model_dirs("llama"))["rope_parameters"]
    assert rope["rope_type"] == "llama3"
    assert rope["factor"] == 8.0 and rope["original_max_position_embeddings"] == 256
    assert _config(model_dirs("llama", "bench"))["rope_parameters"]["rope_type"] == "default"


def test_mistral_sliding_window_is_applied(load, model_dirs) -> None:
    assert _config(model_dirs("mistral"))["sliding_window"] == 64
    assert _config(model_dirs("mistral", "bench"))["sliding_window"] == 1024
    model, _ = load("mistral")
    ids = torch.randint(10, 2000, (1, 160), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[0, 0] = 7
    with torch.no_grad():
        before, after = model(ids).logits[0], model(changed).logits[0]
    # Two layers of a 64-token window see at most ~127 tokens back: position 150 must not
    # notice token 0, while position 50 must.
    torch.testing.assert_close(before[150], after[150])
    assert not torch.allclose(before[50], after[50])


@pytest.mark.parametrize("arch", ARCHS)
def test_special_ids_in_config_and_generation_config(model_dirs, arch: str) -> None:
    path = model_dirs(arch)
    config = _config(path)
    generation = json.loads((path / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 1, 2)
    assert config["dtype"] == "float32"
    assert generation["eos_token_id"] == [1, 4]
    assert (generation["bos_token_id"], generation["pad_token_id"]) == (0, 2)


# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize(
    "text",
    [
        "héllo wörld — 日本語 🚀",
        "  leading spaces, trailing tab\t\n",
        '{"a": [1, -2.5e-3, true, null], "b": "quote \\" and \\\\ slash"}',
        "zero\x00byte, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢, Здравствуйте, ١٢٣ 12345678",
    ],
)
def test_tokenizer_round_trips_any_text(tokenizer, text: str) -> None:
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_tokenizer_matches_tokenizer_json(load, model_dirs, arch: str) -> None:
    # transformers rebuilds some tokenizers in code (qwen2); ids must not depend on the loader.
    raw = Tokenizer.from_file(str(model_dirs(arch) / "tokenizer.json"))
    tok = load(arch)[1]
    assert len(tok) == raw.get_vocab_size()
    for text in [*PROMPTS, "it's   12345 THE end\n\n\tx", "e\u0301 <tool_call>{}</tool_call>"]:
        assert tok(text).input_ids == raw.encode(text).ids


def test_decomposed_accents(load) -> None:
    text = "cafe\u0301"
    for arch in ("llama", "mistral"):
        tok = load(arch)[1]
        assert tok.decode(tok(text).input_ids) == text
    qwen2 = load("qwen2")[1]  # NFC, like real Qwen2 checkpoints
    assert qwen2.decode(qwen2(text).input_ids) == "caf\u00e9"


def test_tokenizer_adds_no_bos(tokenizer) -> None:
    ids = tokenizer("hi").input_ids
    assert ids and tokenizer.bos_token_id not in ids


def test_special_tokens_encode_as_single_ids(tokenizer) -> None:
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3, 4]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == SPECIAL_TOKENS[:3]
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = tokenizer(text).input_ids
    assert ids[0] == 3 and ids[-1] == 4
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_markup_tokens_are_single_and_survive_skip_special(tokenizer) -> None:
    markup_ids = tokenizer.convert_tokens_to_ids(list(MARKUP_TOKENS))
    assert markup_ids == list(range(len(tokenizer) - len(MARKUP_TOKENS), len(tokenizer)))
    text = '<think>\nok\n</think>\n\n<tool_call>\n{"name": "f"}\n</tool_call><|im_end|>'
    ids = tokenizer(text).input_ids
    assert set(markup_ids) <= set(ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == text.removesuffix("<|im_end|>")


# ---------------------------------------------------------------- chat template


def _render(tokenizer, messages: list[dict], **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_chat_template_plain_conversation(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "and "}, {"type": "text", "text": "?"}],
        },
    ]
    assert _render(tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nand ?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not _render(tokenizer, messages[:2]).endswith("<|im_start|>assistant\n")


def test_chat_template_lists_tools_in_system_block(tokenizer) -> None:
    rendered = _render(
        tokenizer,
        [{"role": "user", "content": "Weather?"}],
        tools=[WEATHER_TOOL],
        add_generation_prompt=True,
    )
    assert rendered.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools")
    tools_block = rendered.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert json.loads(tools_block) == WEATHER_TOOL
    assert "Current weather — for a city." in tools_block  # not \u-escaped
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' in rendered
    assert rendered.endswith("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_renders_tool_call_history(tokenizer) -> None:
    calls = [
        {
            "id": "a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
        },
        {
            "id": "b",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Bern"}},
        },
    ]
    messages = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Zürich and Bern?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "a", "content": '{"temp": 3}'},
        {"role": "tool", "tool_call_id": "b", "content": '{"temp": 5}'},
        {"role": "assistant", "content": "Cold in both."},
    ]
    rendered = _render(tokenizer, messages, tools=[WEATHER_TOOL])
    assert rendered.startswith("<|im_start|>system\nUse tools.\n\n# Tools")
    assert (
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call>'
        "<|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp": 3}\n</tool_response>\n'
        '<tool_response>\n{"temp": 5}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\nCold in both.<|im_end|>\n"
    ) in rendered


def test_chat_template_enable_thinking(tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    off = _render(tokenizer, messages, add_generation_prompt=True, enable_thinking=False)
    on = _render(tokenizer, messages, add_generation_prompt=True, enable_thinking=True)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")
    assert on == _render(tokenizer, messages, add_generation_prompt=True)


def test_chat_template_tokenizes_markers_as_special_ids(tokenizer) -> None:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False
    )
    assert ids[0] == 3 and ids.count(3) == 2 and ids.count(4) == 1


# ---------------------------------------------------------------- determinism


def _file_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_gives_identical_files(tmp_path: Path, model_dirs, arch: str) -> None:
    again = make_model(tmp_path / "again", arch=arch, seed=0)
    assert _file_bytes(again) == _file_bytes(model_dirs(arch))


def test_other_seed_changes_weights_only(tmp_path: Path, model_dirs) -> None:
    first, other = _file_bytes(model_dirs("llama")), _file_bytes(make_model(tmp_path, seed=1))
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]
    assert other["config.json"] == first["config.json"]


# ---------------------------------------------------------------- API and CLI errors


@pytest.mark.parametrize(
    "kwargs", [{"arch": "gpt2"}, {"preset": "huge"}, {"seed": -1}, {"seed": 1.5}, {"seed": 2**63}]
)
def test_make_model_rejects_bad_arguments(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        make_model(tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "serve_app.cli", *args]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def test_cli_subprocess_builds_the_same_checkpoint(tmp_path: Path, model_dirs) -> None:
    # A separate process also proves the build does not depend on per-process hash seeds.
    out = tmp_path / "nested" / "model"
    result = _run_cli("make-model", str(out), "--arch", "qwen2")
    assert result.returncode == 0, result.stderr
    assert _file_bytes(out) == _file_bytes(model_dirs("qwen2"))


def test_cli_subprocess_bad_arch_exits_2(tmp_path: Path) -> None:
    result = _run_cli("make-model", str(tmp_path / "m"), "--arch", "x")
    assert result.returncode == 2
    assert "invalid choice: 'x'" in result.stderr


def test_cli_negative_seed_exits_2(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["make-model", str(tmp_path / "m"), "--seed", "-1"])
    assert exc.value.code == 2
    assert "--seed: must be >= 0" in capsys.readouterr().err


def test_cli_refuses_foreign_directory_unless_forced(tmp_path: Path, capsys) -> None:
    (tmp_path / "notes.md").write_text("keep me")
    assert cli.main(["make-model", str(tmp_path)]) == 2
    assert "not a checkpoint made by make-model" in capsys.readouterr().err
    assert (tmp_path / "notes.md").read_text() == "keep me"
    assert cli.main(["make-model", str(tmp_path), "--force"]) == 0
    assert not (tmp_path / "notes.md").exists() and (tmp_path / "config.json").is_file()
    assert cli.main(["make-model", str(tmp_path / "config.json")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_cli_rebuilds_over_a_previous_checkpoint(tmp_path: Path) -> None:
    assert cli.main(["make-model", str(tmp_path), "--arch", "mistral"]) == 0
    assert cli.main(["make-model", str(tmp_path), "--arch", "llama", "--seed", "3"]) == 0
    assert _config(tmp_path)["model_type"] == "llama"
    assert not [p for p in tmp_path.parent.iterdir() if p.name.startswith(f".{tmp_path.name}.")]


def test_cli_serve_refuses_a_folder_that_is_not_a_checkpoint(tmp_path: Path, capsys) -> None:
    assert cli.main(["serve", "--model", str(tmp_path), "--tp", "2", "--port", "9000"]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_cli_serve_refuses_a_public_host_without_api_keys(model_dirs, capsys) -> None:
    model = str(model_dirs("llama"))
    assert cli.main(["serve", "--model", model, "--host", "0.0.0.0"]) == 2
    assert "without API keys" in capsys.readouterr().err
