"""The quickstart notebook runs top to bottom, so it never rots, and leaves no server behind.

Its server is the demo as `make serve` serves it (the trained SmolLM2 folder converted from its
GGUF, the shipped tool-capable template), so while it is up, before the notebook's stop cell,
this test also checks what a user of that server would: the identity naming the GGUF and the
template, seeded samples, stop strings. (The notebook's own cells check the Paris answer, a
schema filled with sensible values and a forced tool call.)"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest

from serve_app.checkpoints.chat_templates import shipped_template_path
from serve_app.checkpoints.identity import weights_hash

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"

SERVER_LINE = re.compile(r"server pid (\d+) serving at \S+:(\d+)")

pytestmark = [pytest.mark.serve, pytest.mark.trained, pytest.mark.timeout(1800)]


def _outputs_text(cell: dict) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return "".join(parts)


def _server_line(nb) -> re.Match | None:
    """The notebook's "server pid N serving at URL" line, once a cell has printed it."""
    texts = (_outputs_text(c) for c in nb.cells if c.cell_type == "code")
    return next(filter(None, (SERVER_LINE.search(t) for t in texts)), None)


def _is_listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _is_running(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited; only its entry is left


TEMPLATE = shipped_template_path("smollm2_tools.jinja")
PARIS = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def _check_served_demo(url: str, trained_gguf: Path, trained_dir: Path) -> None:
    """What a user of the demo server checks beyond the notebook's own cells."""
    info = httpx.get(f"{url}/v1/server_info", timeout=30).json()
    artifact = info["artifact"]
    # The folder was converted from the GGUF: the identity names the file and its quant type,
    # and the dequantized weights have their own hash; the template is the shipped file's.
    assert artifact["gguf_sha256"] == hashlib.sha256(trained_gguf.read_bytes()).hexdigest()
    assert artifact["gguf_quant_type"] == "Q4_1"
    assert artifact["weights_sha256"] == weights_hash(trained_dir)
    assert artifact["chat_template_sha256"] == hashlib.sha256(TEMPLATE.read_bytes()).hexdigest()
    assert artifact["chat_template_source"] == "smollm2_tools.jinja"
    assert info["tool_calling"]["chat_template_renders_tools"] is True

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id

    def sample() -> list[str]:
        reply = client.chat.completions.create(
            model=model, messages=PARIS, n=4, temperature=1.0, seed=11, max_tokens=12
        )
        return [c.message.content for c in reply.choices]

    first = sample()
    # Independent samples (the trained model is peaked: most draws say the same sentence, so
    # the check is that the four are not one answer copied) ...
    assert len(set(first)) > 1, first
    assert sample() == first  # ... and the same four again for the same seed

    stopped = client.chat.completions.create(
        model=model, messages=PARIS, temperature=0, max_tokens=32, stop=["."]
    ).choices[0]
    assert stopped.finish_reason == "stop"
    assert "Paris" in stopped.message.content and "." not in stopped.message.content


def test_quickstart_notebook_runs_and_stops_its_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trained_dir: Path, trained_gguf: Path
) -> None:
    import nbformat
    from nbclient import NotebookClient

    checks: list[BaseException | None] = []

    class CheckedBeforeStop(NotebookClient):
        """Runs `_check_served_demo` on the notebook's server just before its stop cell."""

        async def async_execute_cell(self, cell, cell_index, *args, **kwargs):
            if not checks and cell.cell_type == "code" and cell.source.startswith("stop_server()"):
                started = _server_line(self.nb)
                try:
                    assert started, "no server line before the stop cell"
                    _check_served_demo(
                        f"http://127.0.0.1:{started.group(2)}", trained_gguf, trained_dir
                    )
                    checks.append(None)
                except BaseException as exc:  # noqa: BLE001 (raised after the notebook ends)
                    checks.append(exc)
            return await super().async_execute_cell(cell, cell_index, *args, **kwargs)

    monkeypatch.setenv("QUICKSTART_DIR", str(tmp_path))
    monkeypatch.setenv("QUICKSTART_MODEL", str(trained_dir))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The client owns its kernel, so the kernel ends with execute(), even after a failed cell;
    # the notebook's server must go with it.
    client = CheckedBeforeStop(
        nb,
        timeout=900,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    failure: Exception | None = None
    try:
        client.execute()
    except Exception as exc:  # noqa: BLE001 (checked below, after the cleanup check)
        failure = exc
    texts = [_outputs_text(c) for c in nb.cells if c.cell_type == "code"]
    started = _server_line(nb)
    assert started, f"the notebook never reported its server ({failure})"
    pid, port = int(started.group(1)), int(started.group(2))
    # Stopping Serve and its Ray takes a while on a busy machine.
    deadline = time.monotonic() + 180
    while (_is_running(pid) or _is_listening(port)) and time.monotonic() < deadline:
        time.sleep(1)
    if _is_running(pid):
        os.kill(pid, signal.SIGINT)  # do not leave it behind, but fail: the notebook should have
    assert not _is_running(pid), f"the server (pid {pid}) outlived the notebook ({failure})"
    assert not _is_listening(port), f"port {port} answers after the notebook ended ({failure})"
    if failure is not None:
        raise failure
    assert checks, "the notebook never reached its stop cell"
    if checks[0] is not None:
        raise checks[0]

    joined = "\n".join(texts)
    # What a reader sees: a chat answer in English, a stream, schema-valid JSON naming the
    # right country, a forced tool call, a generation resource replayed under its
    # Idempotency-Key, the batch summary, a plot. (The cells themselves assert that the JSON
    # outputs validate and that the bad batch row failed.)
    assert re.search(r"capital of France is Paris", joined), joined[:2000]
    assert "content deltas, first after" in joined
    assert re.search(r"stop \{'city': 'Paris', 'country': 'France'\}", joined), joined
    assert re.search(r"tool_calls get_weather \{'city': '[^']*Paris", joined), joined
    assert "replayed: true True" in joined
    assert re.search(r"batch: 4 rows -> .*\n  completed \d+, incomplete \d+, failed 1\n", joined)
    assert "server exit code 0" in joined
    # The server's whole output, which the stop cell prints: its banner and a clean stop.
    stop_cell = next(t for t in texts if "server exit code" in t)
    assert "\nready\n" in stop_cell and stop_cell.rstrip().endswith("\nstopped"), stop_cell
    assert not re.search(r"WARNING|ERROR|Traceback", stop_cell), stop_cell
    plots = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(plots) == 1
