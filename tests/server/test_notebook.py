"""The quickstart notebook runs top to bottom, so it never rots, and leaves no server behind."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest

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


def test_quickstart_notebook_runs_and_stops_its_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trained_dir: Path
) -> None:
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("QUICKSTART_DIR", str(tmp_path))
    monkeypatch.setenv("QUICKSTART_MODEL", str(trained_dir))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The client owns its kernel, so the kernel ends with execute(), even after a failed cell;
    # the notebook's server must go with it.
    client = NotebookClient(
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
    started = next(filter(None, (SERVER_LINE.search(t) for t in texts)), None)
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
