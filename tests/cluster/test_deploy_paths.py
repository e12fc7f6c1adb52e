"""Every way of deploying the app gives the same service: `serve deploy CONFIG` on a cluster
started by hand, `serve run IMPORT_PATH` joining it, and `serve run CONFIG` starting its own
Ray. (`serve-app serve` is the session's own path: tests/conftest.py, test_cluster.py.)

Each path: /health is 503 until an engine answers, the admin API answers on `admin_port`,
`/v1/server_info` says whether the proxy hook is installed, and a cluster without it logs
one warning per deploy. The clusters here are Rays of their own, in processes this module
starts and ends (never `ray stop`: it would end every Ray on the machine).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from serve_app import ray_env
from serve_app.backpressure import proxy_hold as proxy_flow
from tests.support.ports import free_port

pytestmark = pytest.mark.serve

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SHIPPED_CONFIG = ROOT / "deploy" / "serve_config.yaml"
WARNING = proxy_flow.MISSING_HOOK_WARNING


def env_without_hook() -> dict[str, str]:
    """This process's environment less Ray's address and our settings (conftest sets them).
    Ray 2.60 starts a cluster with token authentication; its CLIs send the token (from
    ~/.ray/auth_token) only when RAY_AUTH_MODE says so."""
    env = dict(os.environ)
    for name in (*ray_env.SETTINGS, "RAY_ADDRESS"):
        env.pop(name, None)
    env["RAY_AUTH_MODE"] = "token"
    return env


def dashboard_get(url: str, **params) -> httpx.Response:
    token = os.environ.get("RAY_AUTH_TOKEN") or (Path.home() / ".ray" / "auth_token").read_text()
    headers = {"authorization": f"Bearer {token.strip()}"}
    return httpx.get(url, params=params, headers=headers, timeout=30)


def wait_for(check: Callable[[], object], timeout_s: float, what: str) -> object:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            last = check()
            if last:
                return last
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout_s:.0f}s (last: {last!r})")


def config_file(tmp: Path, name: str, port: int, model: Path, **args) -> Path:
    """The shipped deploy/serve_config.yaml with this test's ports, model and `args`."""
    data = yaml.safe_load(SHIPPED_CONFIG.read_text())
    data["http_options"]["port"] = port
    app = data["applications"][0]
    app["args"] = {**app["args"], "model": str(model), **args}
    path = tmp / name
    path.write_text(yaml.safe_dump(data))
    return path


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Output:
    """A child process with its stdout and stderr kept."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            # A stop that lingers is aborted with its threads' tracebacks in the output.
            env={**env, "PYTHONFAULTHANDLER": "1"},
            start_new_session=True,
            # Ctrl-C as in an operator's terminal: a suite started in the background by a
            # shell inherits SIGINT ignored, and `serve run` then sleeps through it.
            preexec_fn=_default_sigint,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def end(self, sig: int = signal.SIGINT, timeout_s: float = 60) -> int:
        """Signal the process (as Ctrl-C would); its whole group is killed if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGABRT)  # faulthandler: where it was stuck
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=10)
                self.kill_group()
        self.kill_group()
        return self.proc.wait()

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def run_cli(*args: str, env: dict[str, str], timeout_s: float = 240) -> str:
    done = subprocess.run(
        [str(BIN / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=10)


def is_unready_503(r: httpx.Response) -> bool:
    """Our ingress's answer while no engine replica answers (not the proxy's own 503)."""
    if r.status_code != 503 or not r.headers.get("content-type", "").startswith("application"):
        return False
    return r.json()["error"]["code"] == "overloaded" and "retry-after" in r.headers


def wait_green(url: str, timeout_s: float = 240) -> list[int]:
    """Poll /health until 200; every earlier answer from our ingress must be its 503."""
    seen: list[int] = []

    def green() -> bool:
        r = health(url)
        if r.status_code == 200:
            return True
        if r.status_code == 503:
            assert is_unready_503(r), r.text
        else:
            assert r.status_code == 404, r.text  # the route is not in the proxy's table yet
        seen.append(r.status_code)
        return False

    wait_for(green, timeout_s, f"{url}/health green")
    return seen


def admin_stats(admin_port: int) -> dict:
    r = httpx.get(f"http://127.0.0.1:{admin_port}/admin/v1/stats", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def engine_reported(admin_port: int) -> bool:
    stats = admin_stats(admin_port)
    return len(stats["replicas"]) == 1 and stats["total"]["kv_blocks_total"] > 0


def detected(url: str) -> bool:
    info = httpx.get(f"{url}/v1/server_info", timeout=10).json()
    return info["backpressure"]["stalled_client"]["detected"]


def refuses(port: int) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{port}/admin/v1/stats", timeout=2)
    except httpx.ConnectError:
        return True
    return False


def warnings_logged(temp_dir: Path) -> int:
    """How many times the missing-hook warning is in the cluster's worker logs (a replica's
    stderr; `serve run` shows it on the terminal too)."""
    logs = temp_dir / "session_latest" / "logs"
    return sum(p.read_text(errors="replace").count(WARNING) for p in logs.glob("worker-*.err"))


# ---------------------------------------------------------------- a cluster started by hand


@contextlib.contextmanager
def hand_started_head(temp_dir: Path) -> Iterator[tuple[str, str]]:
    """`ray start --head --block` without our settings: (GCS address, dashboard URL)."""
    gcs, dashboard = free_port(), free_port()
    command = [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus=2"]
    command += [f"--port={gcs}", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    command += ["--include-dashboard=true", f"--dashboard-port={dashboard}"]
    command += [f"--dashboard-agent-listen-port={free_port()}"]
    command += [f"--ray-client-server-port={free_port()}"]
    head = Output(command, env_without_hook())
    url = f"http://127.0.0.1:{dashboard}"
    try:
        wait_for(
            lambda: dashboard_get(f"{url}/api/serve/applications/").status_code == 200,
            120,
            f"the dashboard's Serve API answering\n{head.text}",
        )
        yield f"127.0.0.1:{gcs}", url
    finally:
        head.end(signal.SIGTERM)
        shutil.rmtree(temp_dir, ignore_errors=True)


def alive_actor_classes(dashboard: str) -> list[str]:
    r = dashboard_get(f"{dashboard}/api/v0/actors", limit=1000)
    actors = r.json()["data"]["result"]["result"]
    return [a["class_name"] for a in actors if a["state"] == "ALIVE"]


def serve_status(dashboard: str) -> str:
    """Serve's own account of the apps and their deployments, for a failure message."""
    try:
        apps = dashboard_get(f"{dashboard}/api/serve/applications/").json()["applications"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return f"(Serve's status unavailable: {exc!r})"
    lines = []
    for name, app in apps.items():
        lines.append(f"app {name}: {app['status']} {app.get('message', '')}")
        for dep, info in app.get("deployments", {}).items():
            lines.append(f"  {dep}: {info['status']} {info.get('message', '')}")
    return "\n".join(lines)


def wait_on_cluster(check: Callable[[], object], timeout_s: float, what: str, dashboard: str):
    """`wait_for`, with Serve's status of every deployment in the message when it fails."""
    try:
        return wait_for(check, timeout_s, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{serve_status(dashboard)}") from None


def no_app_actor_left(dashboard: str) -> bool:
    ours = ("StatsRegistry", "ServeReplica:serve-app", "ServeReplica:second")
    return not [c for c in alive_actor_classes(dashboard) if c.startswith(ours)]


def test_serve_deploy_and_serve_run_on_a_cluster_started_without_the_hook(model_dirs, tmp_path):
    model = model_dirs("llama")
    port, first_admin, second_admin, import_admin = (free_port() for _ in range(4))
    url = f"http://127.0.0.1:{port}"
    env = env_without_hook()
    # Short: Ray's socket paths under it must fit in 107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="rayd", dir="/tmp"))
    with hand_started_head(temp_dir) as (gcs, dashboard):
        # No node can hold this engine replica: the ingress answers, /health stays 503.
        unplaceable = {"admin_port": first_admin, "engine": {"replica_cpus": 64}}
        first = config_file(tmp_path, "first.yaml", port, model, **unplaceable)
        run_cli("serve", "deploy", str(first), "-a", dashboard, env=env)
        wait_for(lambda: is_unready_503(health(url)), 240, "/health 503 from the ingress")
        # The admin replica starts beside the ingress, not before it: its port may bind later.
        wait_for(lambda: admin_stats(first_admin)["replicas"] == [], 120, "an empty admin API")
        assert detected(url) is False
        assert wait_for(lambda: warnings_logged(temp_dir), 30, "the warning logged") == 1

        # A redeploy that places the engine: green, and the admin API moves to its new port.
        second = config_file(tmp_path, "second.yaml", port, model, admin_port=second_admin)
        run_cli("serve", "deploy", str(second), "-a", dashboard, env=env)
        wait_green(url)
        # The admin deployment rolls on its own: its old replica stops, then the new one binds.
        wait_on_cluster(
            lambda: engine_reported(second_admin), 120, "the engine in the admin stats", dashboard
        )
        wait_for(lambda: refuses(first_admin), 30, "the first admin port closed")

        # The import-path form, joining the same cluster (its proxy and port are already up).
        builder = ["serve", "run", "-a", gcs, "--non-blocking", "serve_app.app:app_builder"]
        builder += ["--name", "second", "--route-prefix", "/second"]
        builder += [f"model={model}", "served_model_name=second", f"admin_port={import_admin}"]
        run_cli(*builder, env=env)
        wait_green(f"{url}/second")
        wait_on_cluster(
            lambda: engine_reported(import_admin), 120, "its engine in its admin stats", dashboard
        )
        assert detected(f"{url}/second") is False

        # Deleting the apps stops their admin servers and registries: nothing outlives them.
        run_cli("serve", "shutdown", "-y", "-a", dashboard, env=env)
        for admin_port in (second_admin, import_admin):
            wait_for(lambda p=admin_port: refuses(p), 60, f"admin port {admin_port} closed")
        wait_for(lambda: no_app_actor_left(dashboard), 60, "every app actor gone")


# ---------------------------------------------------------------- `serve run CONFIG`


def test_serve_run_config_with_the_documented_environment_has_the_hook(model_dirs, tmp_path):
    port, admin_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    config = config_file(tmp_path, "run.yaml", port, model_dirs("llama"), admin_port=admin_port)
    env = {**env_without_hook(), **ray_env.SETTINGS}
    # `-a local`: a Ray of its own, whatever else runs on this machine.
    run = Output([str(BIN / "serve"), "run", "-a", "local", str(config)], env)
    try:
        wait_green(url)
        # The admin replica starts beside the ingress, not before it: on a loaded 2-core
        # host it answered more than 60 s after /health was green (120 s, as on a hand-started
        # cluster above).
        wait_for(lambda: engine_reported(admin_port), 120, "the engine in the admin stats")
        assert detected(url) is True
    finally:
        code = run.end(signal.SIGINT, timeout_s=120)  # Serve's own stop, on a busy machine
    assert WARNING not in run.text, run.text
    assert code == 0, run.text
    assert refuses(admin_port)
