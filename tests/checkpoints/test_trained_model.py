"""Our engine on the trained demo model (SmolLM2-135M-Instruct, fp32 on CPU) against
transformers: prefill logits, greedy chat continuations (alone, batched with chunked prefill and
preemption forced, and at TP=3), the chat template, and the GGUF path itself.

The engine is loaded through `LLM(model=FILE.gguf)` (our conversion, actors/models/gguf.py);
transformers loads the converted folder, whose weights are checked against the GGUF's own
dequantized tensors. One LLM serves most of the module: 135M parameters over 30 layers.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from actors import LLM, SamplingParams
from actors.models.gguf import SOURCE_FILE, read_source

pytestmark = [pytest.mark.trained, pytest.mark.parity]

NUM_NEW = 32
CHATS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name two primary colours."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Write a haiku about the sea."},
    ],
    [{"role": "user", "content": "Explain what a prime number is."}],
]


@pytest.fixture(scope="module")
def tokenizer(trained_dir: Path):
    return AutoTokenizer.from_pretrained(trained_dir)


@pytest.fixture(scope="module")
def hf(trained_dir: Path):
    return AutoModelForCausalLM.from_pretrained(trained_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(trained_gguf: Path):
    # Small budgets on purpose: 32-token steps chunk every chat prompt's prefill, and 16 blocks
    # of 16 tokens hold only three of the four chats' 70-90 tokens, so batching all four
    # preempts. A prompt alone still fits.
    engine = LLM(
        model=str(trained_gguf),
        max_num_seqs=4,
        max_num_batched_tokens=32,
        num_kv_blocks=16,
        block_size=16,
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [_ids(tokenizer.apply_chat_template(c, add_generation_prompt=True)) for c in CHATS]


@pytest.fixture(scope="module")
def expected(hf, prompts) -> list[list[int]]:
    return [_hf_greedy(hf, p) for p in prompts]


def _ids(rendered) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True).
    return list(rendered["input_ids"] if not isinstance(rendered, list) else rendered)


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    # NOTE: min_new_tokens masks EOS as our min_tokens does; ignore_eos would only keep going
    # after an EOS that is often the argmax on a trained model (../shared/NOTES.md).
    config = GenerationConfig(
        max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False, pad_token_id=2
    )
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt) :].tolist()


GREEDY = SamplingParams(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0.0)


def test_the_gguf_file_loads_as_its_converted_folder(llm, trained_gguf, trained_dir):
    assert llm.model_config.path == str(trained_dir)
    config = json.loads((trained_dir / "config.json").read_text())
    # An ordinary checkpoint other engines load: an architecture, no GGUF quantization left.
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    names = {p.name for p in trained_dir.iterdir()}
    assert {"chat_template.jinja", "generation_config.json", "tokenizer.json", SOURCE_FILE} <= names
    source = read_source(trained_dir)
    assert source.gguf_sha256 == hashlib.sha256(trained_gguf.read_bytes()).hexdigest()
    assert source.gguf_quant_type == "Q4_1"


def test_serving_the_gguf_file_serves_its_folder_and_names_the_file(trained_gguf, trained_dir):
    """`serve-app serve --model FILE.gguf --chat-template FILE`: what /v1/server_info names."""
    from serve_app.app import served_identity
    from serve_app.checkpoints.chat_templates import shipped_template_path
    from serve_app.checkpoints.identity import weights_hash
    from serve_app.config.options import ServeConfig

    template = shipped_template_path("smollm2_tools.jinja")
    config = ServeConfig(model=str(trained_gguf), chat_template=str(template))
    assert config.model == str(trained_dir)
    assert config.model_id == "SmolLM2-135M-Instruct.Q4_1"  # the file's stem
    identity = served_identity(config, {})
    assert identity["gguf_sha256"] == hashlib.sha256(trained_gguf.read_bytes()).hexdigest()
    assert identity["gguf_quant_type"] == "Q4_1"
    assert identity["weights_sha256"] == weights_hash(trained_dir)
    assert identity["chat_template_sha256"] == hashlib.sha256(template.read_bytes()).hexdigest()
    assert identity["chat_template_source"] == "smollm2_tools.jinja"
    assert identity["chat_template_renders_tools"] is True
    assert identity["model"] == "SmolLM2-135M-Instruct.Q4_1"


# GGUF tensor -> converted name, one per quantization type in the file (Q8_0, Q4_1, F32).
SAMPLED_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
    "blk.29.attn_v.weight": "model.layers.29.self_attn.v_proj.weight",
    "output_norm.weight": "model.norm.weight",
}


def test_converted_weights_are_the_gguf_tensors_dequantized(trained_gguf, trained_dir):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {t.name: t for t in GGUFReader(trained_gguf).tensors}
    with safe_open(str(trained_dir / "model.safetensors"), framework="pt") as f:
        # The tied head is the embedding; it is not stored twice.
        assert "lm_head.weight" not in set(f.keys())  # noqa: SIM118 (not a mapping)
        for gguf_name, name in SAMPLED_TENSORS.items():
            t = tensors[gguf_name]
            values = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
            assert torch.equal(f.get_tensor(name), values.reshape(f.get_slice(name).get_shape()))


def _prefill_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Every position's logits of one prefill through the paged path."""
    from actors.forward_context import set_forward_context
    from actors.messages import ScheduledItem

    runner = llm.engine.executor.worker.runner
    # NOTE: an idle engine whose first blocks hold no cached prefix: the probe overwrites them.
    table = list(range(llm.engine.block_manager.blocks_needed(len(prompt))))
    item = ScheduledItem("probe", prompt, 0, table, sample=True)
    input_ids, positions, meta, _, _ = runner._prepare([item])
    with torch.no_grad(), set_forward_context(meta):
        hidden = runner.model(input_ids, positions, runner.kv_caches)
    return runner.model.compute_logits(hidden)


def test_prefill_logits_match_transformers_at_every_position(
    llm, hf, prompts, trained_dir, monkeypatch
):
    prompt = prompts[2]  # the multi-turn chat: several KV blocks
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0]
    # The plain GEMM path: the same products as transformers.
    monkeypatch.setenv("SERVE_APP_CPU_PREPACK", "0")
    monkeypatch.setenv("SERVE_APP_CPU_PANEL_LINEAR", "0")
    with LLM(model=str(trained_dir), num_kv_blocks=16) as dense:
        ours = _prefill_logits(dense, prompt)
    assert ours.shape == theirs.shape == (len(prompt), 49152)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    # The default path (oneDNN's packed weights; the panels at a few rows) sums in another
    # order; the residual stream of this model reaches ~2.5e4, so its fp32 rounding shows at
    # ~1e-5 of the logits' scale.
    packed = _prefill_logits(llm, prompt)
    scale = theirs.abs().max().item()
    torch.testing.assert_close(packed, theirs, atol=2e-5 * scale, rtol=1e-4)


def test_greedy_chat_continuations_match_alone_and_batched(llm, prompts, expected, tokenizer):
    alone = [llm.generate([p], GREEDY)[0] for p in prompts]
    assert [r.token_ids for r in alone] == expected
    # All four at once, with a seeded sampled request mixed in: chunked prefill, preemption.
    before = llm.stats()["num_preemptions"]
    sampled = SamplingParams(max_tokens=NUM_NEW, temperature=1.0, seed=3)
    batched = llm.generate([*prompts, prompts[0]], [GREEDY] * len(prompts) + [sampled])
    assert llm.stats()["num_preemptions"] > before, "the budgets should have forced preemption"
    assert [r.token_ids for r in batched[: len(prompts)]] == expected
    assert llm.stats()["kv_blocks_used"] == 0
    # And it is the model answering, not noise: the Paris question gets Paris.
    assert "Paris" in tokenizer.decode(expected[0])


@pytest.mark.ray
def test_tp3_equals_tp1_and_tp2_names_the_heads(ray_session, trained_dir, prompts, expected):
    with LLM(model=str(trained_dir), tensor_parallel_size=3) as tp3:
        outputs = tp3.generate(prompts[:2], GREEDY)
    assert [o.token_ids for o in outputs] == expected[:2]
    # 9 query heads over 3 KV heads: 2 ranks cannot split them, and startup says so.
    with pytest.raises(ValueError, match=r"\(2\).*num_attention_heads \(9\).*\(3\)"):
        LLM(model=str(trained_dir), tensor_parallel_size=2)


def test_chat_rendering_equals_transformers(trained_dir, tokenizer):
    """Our tokenizer service's render path gives transformers' ids for the model's template."""
    from serve_app.workers.tokenizer import TokenizerService

    service = TokenizerService(str(trained_dir))
    for chat in CHATS:
        for add in (True, False):
            expected_ids = _ids(tokenizer.apply_chat_template(chat, add_generation_prompt=add))
            assert service.render_chat(chat, add_generation_prompt=add) == expected_ids
    assert service.renders_tools is False  # SmolLM2's own template drops `tools`


def test_shipped_tools_template_renders_the_models_own_chats_and_tools(trained_dir, tokenizer):
    from serve_app.checkpoints.chat_templates import resolve_chat_template, shipped_template_path
    from serve_app.workers.tokenizer import TokenizerService

    template = resolve_chat_template(shipped_template_path("smollm2_tools.jinja"), None)
    service = TokenizerService(str(trained_dir), template=template)
    assert service.renders_tools is True
    # Without tools it is the model's own template, token for token.
    for chat in CHATS:
        expected_ids = _ids(tokenizer.apply_chat_template(chat, add_generation_prompt=True))
        assert service.render_chat(chat) == expected_ids
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    text = tokenizer.decode(service.render_chat(CHATS[0], tools=[tool]))
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_tools_are_refused_naming_the_template_when_it_cannot_render_them(trained_dir, tmp_path):
    """SmolLM2's own template, given as --chat-template FILE, renders no tools: a request's
    `tools` is a 400 naming the file, never silently dropped; without tools it renders."""
    from serve_app import errors
    from serve_app.checkpoints.chat_templates import resolve_chat_template
    from serve_app.workers.tokenizer import TokenizerService

    own = tmp_path / "smollm2_own.jinja"
    own.write_text((trained_dir / "chat_template.jinja").read_text())
    service = TokenizerService(str(trained_dir), template=resolve_chat_template(str(own), None))
    assert service.renders_tools is False
    assert service.render_chat(CHATS[0])  # a plain chat still renders
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    with pytest.raises(errors.APIError) as info:
        service.render_chat(CHATS[0], tools=[tool])
    err = info.value
    assert (err.status, err.code, err.param) == (400, "unsupported_parameter", "tools")
    assert "smollm2_own.jinja" in err.message and err.headers["x-should-retry"] == "false"
