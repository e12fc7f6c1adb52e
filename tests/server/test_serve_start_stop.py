"""`serve-app serve` as an operator runs it: a taken port is one line and exit 2 before Ray
starts; a clean start prints the banner and nothing alarming; Ctrl-C stops it cleanly."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from serve_app import ports
from serve_app.cli import main
from serve_app.ports import LINGERING, Listener, PortInUse, bind_problem, check_free, listening
from tests.support.ports import free_port

SERVE_APP = str(Path(sys.executable).with_name("serve-app"))
# What an operator would read as trouble: Python's and Ray's warnings and errors (glog lines
# look like "[2026-01-01 10:00:00,000 W 123 123] ..."), tracebacks, failed tasks.
ALARMING = re.compile(
    r"WARNING|ERROR|Error|Traceback|failed|^\[\d{4}-\d\d-\d\d [\d:,.]+ [WEF] \d+ \d+\]",
    re.MULTILINE,
)


@contextmanager
def held_port() -> Iterator[int]:
    """A loopback port that another program listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def serve_env(ray_dir: Path | None = None) -> dict[str, str]:
    """The operator's environment: no Ray to join, Ray's own auth default."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    if ray_dir is not None:
        env["RAY_TMPDIR"] = str(ray_dir)
    return env


@contextmanager
def short_ray_dir() -> Iterator[Path]:
    """A folder for a server's own Ray, removed afterwards. Its path is short on purpose: Ray
    puts Unix sockets three folders deep under it (ray/session_<time>_<pid>/sockets/...), an
    AF_UNIX path has at most 107 bytes, and pytest's tmp_path (pytest-of-<user>/pytest-<n>/...)
    leaves too little room once n has three digits."""
    path = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------ taken ports


def test_a_taken_port_is_one_line_and_exit_2_before_ray_starts(model_dirs, tmp_path):
    with held_port() as taken:
        args = [SERVE_APP, "serve", "--model", str(model_dirs("llama")), "--port", str(taken)]
        done = subprocess.run(
            [*args, "--admin-port", str(free_port())],
            env=serve_env(tmp_path / "ray"),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2
    assert done.stderr == f"serve-app serve: error: port {taken} is in use (--port)\n"
    assert done.stdout == ""
    assert not (tmp_path / "ray").exists()  # no Ray was started


@contextmanager
def lingering_port() -> Iterator[int]:
    """A port nothing listens on any more, held by one connection its server closed first
    (TIME_WAIT), as a direct-ingress replica leaves it: bound without SO_REUSEADDR."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            accepted.close()  # the server closes first
            assert client.recv(1) == b""
    yield port


def test_a_port_held_only_by_closed_connections_is_waited_for_then_named(capsys):
    with lingering_port() as port:
        assert listening(port) is False
        assert bind_problem("127.0.0.1", port, reuse_addr=False) == LINGERING
        said: list[str] = []
        listener = Listener("127.0.0.1", port, "--port", reuse_addr=False)
        with pytest.raises(PortInUse) as refused:
            check_free([listener], linger_wait_s=0.5, say=said.append)
    assert str(refused.value) == f"port {port} {LINGERING} (--port)"
    assert said == [f"port {port} {LINGERING}: waiting for it (at most 0 s)"]


def test_a_start_waits_out_a_lingering_port_then_goes_on(monkeypatch):
    answers = iter([LINGERING, LINGERING, None])
    monkeypatch.setattr(ports, "bind_problem", lambda *_: next(answers))
    said: list[str] = []
    ports.check_free([Listener("127.0.0.1", 8000, "--port")], say=said.append)
    assert said == [f"port 8000 {LINGERING}: waiting for it (at most 65 s)"]
    assert next(answers, "drained") == "drained"


def test_the_python_start_waits_out_a_lingering_direct_ingress_port(monkeypatch, model_dirs):
    # `serve_app.server.start` (notebooks, benchmarks) restarting a direct-ingress server on
    # its port: the replica binds without SO_REUSEADDR, so the wait comes before Ray starts.
    import ray

    from serve_app import ray_env, server
    from serve_app.config.options import ServeConfig

    class BeforeRay(Exception):
        pass

    def no_ray(*_args, **_kwargs):
        raise BeforeRay

    checked: list[Listener] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(server, "check_free", lambda listeners, say: checked.extend(listeners))
    monkeypatch.setattr(ray_env, "prepare", no_ray)
    config = ServeConfig(model=str(model_dirs("llama")), port=free_port(), direct_ingress=True)
    with pytest.raises(BeforeRay):
        server.start(config)
    assert checked == [Listener(config.host, config.port, "port", reuse_addr=False)]

    checked.clear()  # through Serve's proxy, which binds with SO_REUSEADDR: nothing to wait for
    with pytest.raises(BeforeRay):
        server.start(config.model_copy(update={"direct_ingress": False}))
    assert checked == []


def test_a_port_someone_listens_on_is_in_use_at_once():
    with held_port() as taken:
        said: list[str] = []
        with pytest.raises(PortInUse, match=f"port {taken} is in use"):
            check_free([Listener("127.0.0.1", taken, "--port", reuse_addr=False)], say=said.append)
    assert said == []


def test_a_taken_admin_port_is_named_by_its_flag(model_dirs, capsys):
    with held_port() as taken:
        args = ["serve", "--model", str(model_dirs("llama")), "--port", str(free_port())]
        status = main([*args, "--admin-port", str(taken)])
    assert status == 2
    assert capsys.readouterr().err == (
        f"serve-app serve: error: port {taken} is in use (--admin-port)\n"
    )


def test_a_taken_port_from_the_config_file_names_the_file(model_dirs, tmp_path, capsys):
    with held_port() as taken:
        config = tmp_path / "serve.yaml"
        config.write_text(f"model: {model_dirs('llama')}\nadmin_port: {taken}\n")
        status = main(["serve", "--config", str(config), "--port", str(free_port())])
    assert status == 2
    assert capsys.readouterr().err == (
        f"serve-app serve: error: port {taken} is in use (admin_port in {config})\n"
    )


def test_the_same_port_for_both_apis_is_refused(model_dirs, capsys):
    port = str(free_port())
    status = main(
        ["serve", "--model", str(model_dirs("llama")), "--port", port, "--admin-port", port]
    )
    assert status == 2
    assert capsys.readouterr().err == (
        f"serve-app serve: error: port {port} is named twice (--port and --admin-port)\n"
    )


# ------------------------------------------------------------------- clean start and stop


class Output:
    """A stream's lines as they come, read on a thread so the child never blocks on a pipe."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, proc: subprocess.Popen, stderr: Output, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.lines:
            if proc.poll() is not None:
                pytest.fail(f"serve exited {proc.returncode}: {self.lines} {stderr.text()}")
            assert time.monotonic() < deadline, f"no {text!r} within {timeout_s}s: {self.lines}"
            time.sleep(0.2)

    def text(self) -> str:
        self._thread.join(timeout=30)
        return "\n".join(self.lines)


def start_serve(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, Output, Output]:
    """`serve-app serve ARGS` as an operator starts it; its stdout and stderr read as they come."""
    proc = subprocess.Popen(
        [SERVE_APP, "serve", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, Output(proc.stdout), Output(proc.stderr)


def engine_reported(admin_stats_url: str, timeout_s: float = 30) -> bool:
    """The admin API answers and, within a few reports, counts the engine's KV blocks."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = httpx.get(admin_stats_url, timeout=30)
        assert r.status_code == 200, r.text
        if r.json()["total"]["kv_blocks_total"] > 0:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.serve
@pytest.mark.timeout(900)
def test_a_clean_start_prints_the_banner_and_ctrl_c_stops_cleanly(model_dirs):
    model = model_dirs("llama")
    port, admin_port = free_port(), free_port()
    args = ["--model", str(model), "--port", str(port), "--admin-port", str(admin_port)]
    proc, out, err = start_serve(args, serve_env())
    try:
        out.wait_for("ready", proc, err, timeout_s=600)
        url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}/admin/v1/stats"
        # The banner's addresses answer.
        assert httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"] == model.name
        assert engine_reported(admin)
        proc.send_signal(signal.SIGINT)
        status = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stdout, stderr = out.text(), err.text()
    assert status == 0, stdout + stderr
    assert not ALARMING.findall(stdout + "\n" + stderr), stdout + stderr
    assert stdout.splitlines() == [
        f"starting {model.name} from {model} ...",
        "ready",
        f"  model      {model.name} ({model})",
        f"  OpenAI API {url}/v1",
        f"  admin API  {admin}",
        "  stop       Ctrl-C (or SIGTERM)",
        "stopping (Ctrl-C again to force)",
        "stopped",
    ]
    assert stderr == ""
    with socket.socket() as s:  # the port is free again for the next start
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
