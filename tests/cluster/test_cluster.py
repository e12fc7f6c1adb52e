"""The graph on a simulated multi-node cluster: a CPU-only head and two nodes with 2 fake GPUs.

Isolation: `ray.init` happens once per process and the test session already holds a local
Ray, so the cluster lives in a driver process of its own (tests/support/cluster.py) and the
server is the real `serve-app serve --address ...` in another. This module talks to them
over HTTP and JSON lines; it never joins the cluster itself. Both processes are ended in the
fixtures' finalizers, and Ray's reaper removes the node processes if the driver dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.ports import free_port

pytestmark = pytest.mark.serve

ROOT = Path(__file__).resolve().parents[2]
SERVE_APP = [sys.executable, "-m", "serve_app.cli", "serve"]
PLACEMENT_TIMEOUT_S = 8
# Long enough to outlast the kill on a fast machine (tiny model, ~5 ms a step).
STREAM_TOKENS = 800
MAX_KILL_STREAMS = 16
# Requests the spread test sends one at a time after its burst, at most, for Serve's router
# to reach the second replica.
MAX_SPREAD_TOP_UP = 16


class SimCluster:
    """The driver process that owns the cluster; answers one JSON command per line."""

    def __init__(self, attempts: int = 3) -> None:
        for attempt in range(attempts):
            # NOTE: Ray gives a node 30 s to register; on a loaded machine the head can miss
            # that. A failed driver exits (Ray's reaper removes what it started): start again.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.cluster"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
            try:
                ready = self._read("READY")
                break
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
        self.address: str = ready["address"]
        self.head = next(n["node_id"] for n in ready["nodes"] if n["is_head"])
        self.gpu_nodes = {n["node_id"] for n in ready["nodes"] if n["gpus"] == 2}

    def _read(self, tag: str) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(f"{tag} "):
                return json.loads(line[len(tag) + 1 :])
        raise RuntimeError(f"cluster driver exited ({self.proc.wait()}) before {tag}")

    def ask(self, cmd: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd}) + "\n")
        self.proc.stdin.flush()
        return self._read("REPLY")

    def close(self) -> None:
        try:
            self.ask_exit()
            self.proc.wait(timeout=90)
        except Exception:  # noqa: BLE001 (a driver that will not stop is killed)
            self.proc.kill()
            self.proc.wait()

    def ask_exit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write('{"cmd": "exit"}\n')
        self.proc.stdin.close()


class Server:
    """`serve-app serve --address CLUSTER ...` in its own process, its output kept."""

    def __init__(self, cluster: SimCluster, model: Path, *args: str) -> None:
        self.port, self.admin_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin_url = f"http://127.0.0.1:{self.admin_port}"
        command = [*SERVE_APP, "--address", cluster.address, "--model", str(model)]
        command += ["--port", str(self.port), "--admin-port", str(self.admin_port), *args]
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
        )
        self.lines: list[str] = []
        self.serving = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if line == "ready\n":  # the banner's first line: /health is green
                self.serving.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.serving.wait(1):
            assert self.proc.poll() is None, f"server exited:\n{self.output}"
            assert time.monotonic() < deadline, f"not serving in {timeout_s}s:\n{self.output}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def stats(self) -> dict:
        return httpx.get(f"{self.admin_url}/admin/v1/stats", timeout=10).json()


@pytest.fixture(scope="module")
def cluster():
    sim = SimCluster()
    try:
        yield sim
    finally:
        sim.close()


@pytest.fixture(scope="module")
def served(cluster, model_dirs):
    """Two engine replicas with TP=2 each: one replica per GPU node."""
    server = Server(cluster, model_dirs("llama"), "--tp", "2", "--replicas", "2")
    try:
        server.wait_serving(timeout_s=300)
        yield server
    finally:
        server.stop()


def _completion(url: str, max_tokens: int = 8) -> httpx.Response:
    body = {"model": "llama-tiny-0", "prompt": "Hello there", "max_tokens": max_tokens}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def _topology(cluster: SimCluster) -> dict:
    return cluster.ask("topology")


def _replicas_of(topology: dict, deployment: str) -> list[dict]:
    prefix = f"ServeReplica:serve-app:{deployment}"
    return [a for a in topology["actors"] if a["class_name"] == prefix]


def _ranks_of(topology: dict, replica: dict) -> list[dict]:
    """The TP workers an engine replica started (it owns them)."""
    workers = [a for a in topology["actors"] if a["class_name"] == "RayWorkerShell"]
    return [w for w in workers if w["owner_port"] == replica["port"]]


# ------------------------------------------------------------------------------ tests
# NOTE: the unplaceable case runs first, on the cluster alone: it tears its own Serve down.


def test_tp4_on_2_gpu_nodes_fails_within_the_placement_timeout_naming_bundles_and_node(
    cluster, model_dirs, tmp_path
):
    config = tmp_path / "serve.yaml"
    config.write_text(f"engine:\n  placement_timeout_s: {PLACEMENT_TIMEOUT_S}\n")
    started = time.monotonic()
    server = Server(cluster, model_dirs("llama"), "--tp", "4", "--config", str(config))
    health: list[int] = []
    try:
        while server.proc.poll() is None and time.monotonic() - started < 240:
            # Not listening yet, or already gone: nothing to record.
            with contextlib.suppress(httpx.HTTPError):
                health.append(httpx.get(f"{server.url}/health", timeout=10).status_code)
            time.sleep(0.5)
        elapsed = time.monotonic() - started
        assert server.proc.wait(timeout=30) == 1, server.output
    finally:
        server.stop()
    out = server.output
    assert "engine replica(s) could not be placed" in out, out
    assert f"within {PLACEMENT_TIMEOUT_S}s" in out
    rank = "{'GPU': 1.0, 'CPU': 1.0}"
    assert f"[{{'CPU': 1.0}}, {rank}, {rank}, {rank}, {rank}] (STRICT_PACK)" in out
    assert "needs {'CPU': 5.0, 'GPU': 4.0} on one node" in out
    assert "the largest of the 3 nodes has {'CPU': 3.0, 'GPU': 2.0}" in out
    assert "ready\n" not in out
    # Never green while no engine could be placed (the ingress itself was up).
    assert 200 not in health, health
    # Bounded: process start and Serve start-up, then the placement timeout, then teardown.
    assert elapsed < PLACEMENT_TIMEOUT_S + 150, elapsed
    print(f"unplaceable: exited after {elapsed:.1f}s (placement timeout {PLACEMENT_TIMEOUT_S}s)")
    pending = [pg for pg in _topology(cluster)["placement_groups"] if pg["state"] == "PENDING"]
    assert pending == [], "the unplaceable group is removed with the application"


def test_cpu_deployments_on_the_head_and_each_replicas_ranks_on_one_gpu_node(served, cluster):
    topology = _topology(cluster)
    for deployment in ("ingress", "tokenizer", "grammar", "admin", "responses"):
        replicas = _replicas_of(topology, deployment)
        assert replicas and {r["node_id"] for r in replicas} == {cluster.head}, deployment
    for cls in ("ProxyActor", "StatsRegistry", "ServeController"):
        nodes = {a["node_id"] for a in topology["actors"] if a["class_name"] == cls}
        assert nodes == {cluster.head}, cls
    engines = _replicas_of(topology, "engine")
    assert len(engines) == 2
    assert {e["node_id"] for e in engines} == cluster.gpu_nodes, "one replica per GPU node"
    for engine in engines:
        ranks = _ranks_of(topology, engine)
        assert len(ranks) == 2
        assert {r["node_id"] for r in ranks} == {engine["node_id"]}
    groups = [
        pg
        for pg in topology["placement_groups"]
        if "#engine#" in pg["name"] and pg["state"] == "CREATED"
    ]
    assert len(groups) == 2
    for pg in groups:
        assert pg["strategy"] == "STRICT_PACK"
        assert pg["bundles"] == [{"CPU": 1.0}] + [{"GPU": 1.0, "CPU": 1.0}] * 2
        assert len(set(pg["bundles_to_node_id"].values())) == 1


def test_ranks_hold_fake_gpus_but_run_on_cpu_and_say_so(served, cluster):
    topology = _topology(cluster)
    logs = Path(cluster.ask("logs_dir")["logs_dir"])
    pids = [a["pid"] for a in topology["actors"] if a["class_name"] == "RayWorkerShell"]
    assert len(pids) == 4
    for pid in pids:
        text = "".join(p.read_text(errors="replace") for p in logs.glob(f"worker-*-{pid}.*"))
        assert "torch sees no CUDA device: running on CPU" in text, pid


def test_requests_spread_over_two_tp2_replicas(served, cluster):
    """Serve's router may send a whole burst to one replica (one whose queue length it has
    cached wins over one it must probe), so requests are then sent one at a time, at most
    `MAX_SPREAD_TOP_UP` more, until both replicas served some."""
    before = {r["replica"]: r["requests_total"] for r in served.stats()["replicas"]}
    assert len(before) == 2
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda _: _completion(served.url), range(24)))
    assert [r.status_code for r in responses] == [200] * 24
    sent = 24
    stats = _wait_replicas_sum(served, "requests_total", sent, before, within_s=10)
    while min(r["requests_total"] - before[r["replica"]] for r in stats["replicas"]) == 0:
        assert sent < 24 + MAX_SPREAD_TOP_UP, f"one replica took everything: {stats}"
        r = _completion(served.url)
        assert r.status_code == 200, r.text
        sent += 1
        stats = _wait_replicas_sum(served, "requests_total", sent, before, within_s=10)
    assert {r["node_id"] for r in stats["replicas"]} == cluster.gpu_nodes


def test_killed_rank_fails_its_streams_the_other_replica_serves_and_serve_replaces_it(
    served, cluster
):
    """Runs last: it breaks a replica on purpose.

    Serve's router may send a burst of streams to one replica (one whose queue length
    it has cached wins over one it must probe), so streams are added one at a time
    until both replicas run some."""
    results: list[dict] = []
    futures = []
    with ThreadPoolExecutor(MAX_KILL_STREAMS) as pool:

        def start(count: int) -> dict:
            """Start `count` more streams; the stats once every stream runs."""
            for _ in range(count):
                results.append({"started": threading.Event()})
                futures.append(pool.submit(_stream, served.url, results[-1]))
            deadline = time.monotonic() + 120
            for r, f in zip(results, futures, strict=True):  # all past headers, producing
                while not r["started"].wait(0.5):
                    if f.done():
                        f.result()  # a stream that failed before its first token says why
                    assert time.monotonic() < deadline, "a stream did not start"
            return _wait_replicas_sum(served, "live_requests", len(results))

        snapshot = start(8)
        while min(r["live_requests"] for r in snapshot["replicas"]) == 0:
            assert len(results) < MAX_KILL_STREAMS, f"every stream on one replica: {snapshot}"
            snapshot = start(1)
        victim = max(snapshot["replicas"], key=lambda r: r["live_requests"])
        survivor = next(r for r in snapshot["replicas"] if r is not victim)
        topology = _topology(cluster)
        (engine,) = [
            e for e in _replicas_of(topology, "engine") if e["name"].endswith(victim["replica"])
        ]
        os.kill(_ranks_of(topology, engine)[1]["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        for f in futures:
            f.result(timeout=300)
    endings = Counter(r["ending"] for r in results)
    assert endings == {"error": victim["live_requests"], "length": survivor["live_requests"]}
    for r in results:
        assert r["events"][-1] == "[DONE]"
        if r["ending"] == "error":
            assert r["events"][-2]["error"]["code"] == "engine_lost"
            assert r["events"][-2]["error"]["type"] == "server_error"
        else:  # the survivor's streams ran to the end, usage included
            assert r["events"][-2]["usage"]["completion_tokens"] == STREAM_TOKENS
    replaced = _wait_replaced(served, victim["replica"], within_s=150)
    print(f"replica replaced and reporting {time.monotonic() - killed_at:.1f}s after the kill")
    assert {r["node_id"] for r in replaced["replicas"]} == cluster.gpu_nodes
    r = _completion(served.url)
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------- helpers


def _stream(url: str, result: dict) -> None:
    """One streamed completion; `result` gets its events and how it ended, and its
    `started` event is set at the first token."""
    body = {
        "model": "llama-tiny-0",
        "prompt": "Once upon a time",
        "max_tokens": STREAM_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events: list = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                result["started"].set()
    result["events"] = events
    chunks = [e for e in events[:-1] if "error" not in e]
    finishes = [c["finish_reason"] for e in chunks for c in e["choices"] if c["finish_reason"]]
    result["ending"] = "error" if "error" in events[-2] else finishes[-1]


def _wait_replicas_sum(
    server: Server, key: str, num: int, before: dict | None = None, within_s: float = 60
) -> dict:
    """A stats snapshot once the two replicas' `key` (less each one's `before`, by replica)
    sums to `num` (replicas report their stats a few times a second)."""
    before = before or {}
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        stats = server.stats()
        counts = [r[key] - before.get(r["replica"], 0) for r in stats["replicas"]]
        if len(counts) == 2 and sum(counts) == num:
            return stats
        time.sleep(0.1)
    raise AssertionError(f"{key} not {num} on the two replicas: {server.stats()}")


def _wait_replaced(server: Server, dead_replica: str, within_s: float) -> dict:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        stats = server.stats()
        ids = [r["replica"] for r in stats["replicas"]]
        if len(ids) == 2 and dead_replica not in ids:
            return stats
        time.sleep(0.5)
    raise AssertionError(f"replica {dead_replica} not replaced in {within_s}s: {server.stats()}")
