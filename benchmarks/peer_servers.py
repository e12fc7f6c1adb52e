"""The servers `peer.py` compares, each as a process of its own: ours (`serve-app serve`), vLLM's
CPU build and `transformers serve`, started on a free port, healthy once `/health` answers, and
stopped with every process they started gone before the next one runs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(__file__))
import vllm_peer  # noqa: E402
from common import free_port, venv_tool  # noqa: E402
from cpu_accounting import live_pids, tree_pids  # noqa: E402


class ServerProcess:
    """An HTTP server in its own process group, up once `/health` answers 200."""

    def __init__(self, name: str, argv: list[str], port: int, log_dir: str, env: dict) -> None:
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.log = Path(log_dir) / f"{name}.log"
        self.proc = subprocess.Popen(
            argv,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy after {timeout_s:.0f}s; see {self.log}")

    def model_id(self) -> str:
        return httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]

    def stop(self) -> None:
        """Stop the server and wait until every process it started is gone, so that nothing
        of it (a Ray worker, vLLM's engine process) runs into the next server's levels."""
        if self.proc.poll() is not None:
            return
        started = tree_pids(self.proc.pid)
        self.proc.send_signal(signal.SIGINT)  # both shut down cleanly on Ctrl-C
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        deadline = time.monotonic() + STOP_GRACE_S
        while (left := live_pids(started)) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in left:  # outlived the grace period: not allowed to weigh on what runs next
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if left:
            print(f"{self.name}: killed {len(left)} processes left after stop", file=sys.stderr)


# How long a stopped server's processes get to exit on their own before they are killed.
STOP_GRACE_S = 20.0


def start_ours(
    path: str,
    threads: int,
    log_dir: str,
    env: dict,
    dtype: str = "float32",
    direct_ingress: bool = False,
) -> ServerProcess:
    config = Path(log_dir) / "ours.yaml"
    # A generous placement timeout: a busy machine can be slow to start the replica's worker.
    # No first-token bound (vLLM has none): at 64 streams on the trained model the last
    # requests of a level wait past the default 60 s for their first step and would be shed.
    engine = {
        "replica_cpus": threads,
        "placement_timeout_s": 600,
        "dtype": dtype,
        "max_queue_s": None,
        "kv_cache_bytes": vllm_peer.KV_CACHE_GIB * 1024**3,  # as much as vLLM is given
    }
    # With direct_ingress the ingress replica serves HTTP itself, on the fixed --port below.
    settings = {"model": path, "engine": engine, "direct_ingress": direct_ingress}
    config.write_text(json.dumps(settings))
    port = free_port()
    argv = [venv_tool("serve-app"), "serve", "--config", str(config), "--port", str(port)]
    argv += ["--admin-port", str(free_port())]
    return ServerProcess("ours", argv, port, log_dir, env)


def start_vllm(path: str, threads: int, log_dir: str, dtype: str = "float32") -> ServerProcess:
    vllm_peer.ensure_venv()
    port = free_port()
    argv = vllm_peer.server_argv(path, port, dtype, served_name=Path(path).name)
    return ServerProcess("vllm", argv, port, log_dir, vllm_peer.environment(threads, log_dir))


def start_theirs(path: str, log_dir: str, env: dict, dtype: str = "float32") -> ServerProcess:
    port = free_port()
    argv = [venv_tool("transformers"), "serve", path, "--continuous-batching", "--device", "cpu"]
    argv += ["--dtype", dtype]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    return ServerProcess("theirs", argv, port, log_dir, env)
