"""`make conformance-diff REV=<rev>`: the suite against a past revision and against this working
tree, each served in turn on the same checkpoint and free ports, and the diff of the two records.

The revision is checked out in a temporary git worktree and served from a venv of its own: one
per revision's `pyproject.toml` (built once, cached under ~/.cache/serve-app/conformance/venvs/),
into which the revision's own code is installed on every run. The working tree is served from
the venv that runs this command. Exit status: 0, or 1 when the diff finds a regression.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from serve_app.conformance.cases import select
from serve_app.conformance.changes import load_changes
from serve_app.conformance.diff import diff_records
from serve_app.conformance.record import Record
from serve_app.conformance.report import write_report
from serve_app.conformance.runner import run_suite
from serve_app.conformance.session import Target

CACHE = Path(os.environ.get("SERVE_APP_CACHE", Path.home() / ".cache" / "serve-app"))
ROOT = CACHE / "conformance"
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 90.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve_app.conformance.revisions")
    parser.add_argument("rev", help="the git revision to compare this working tree against")
    parser.add_argument("--model", help="checkpoint folder (default: the seeded tiny llama)")
    parser.add_argument("--out", help="where the records and the report go")
    parser.add_argument("--changes", help="the changes file (default: this tree's)")
    parser.add_argument("--fast", action="store_true", help="only the fast subset")
    args = parser.parse_args(argv)

    repo = Path(_git(Path.cwd(), "rev-parse", "--show-toplevel"))
    sha = _git(repo, "rev-parse", "--verify", f"{args.rev}^{{commit}}")
    out = Path(args.out or ROOT / "runs" / f"{sha[:12]}-vs-worktree")
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else seeded_checkpoint()
    changes = load_changes(args.changes)
    started = time.monotonic()
    with worktree(repo, sha) as tree:
        _say(f"{args.rev} ({sha[:12]}) checked out in {tree}")
        serve_app = revision_venv(tree, out / "pip.log") / "bin" / "serve-app"
        # Fault injection only where both revisions have the setting (a verdict moves else).
        faults = knows_fault_injection(tree)
        old = serve_and_run([str(serve_app)], tree, model, out / "old", args.fast, faults)
    here = [sys.executable, "-m", "serve_app.cli"]
    new = serve_and_run(here, repo, model, out / "new", args.fast, faults)
    report = diff_records(old, new, changes)
    md, js = write_report(report, out / "report")
    _say(f"{report.summary_line()} in {time.monotonic() - started:.0f} s")
    _say(f"records {out / 'old.json'} and {out / 'new.json'}; report {md} and {js}")
    return 1 if report.has_regression else 0


def _say(message: str) -> None:
    print(f"==> {message}", file=sys.stderr, flush=True)


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def seeded_checkpoint() -> Path:
    """The tiny seeded llama, written once by this tree's factory (same seed, same bytes)."""
    path = ROOT / "models" / "tiny-llama"
    if not (path / "config.json").is_file():
        _say(f"writing the tiny seeded checkpoint to {path}")
        cmd = [sys.executable, "-m", "serve_app.cli", "make-model", str(path), "--preset", "tiny"]
        subprocess.run(cmd, check=True)
    return path


@contextmanager
def worktree(repo: Path, sha: str) -> Iterator[Path]:
    parent = Path(tempfile.mkdtemp(prefix="serve-app-rev-"))
    tree = parent / "tree"
    _git(repo, "worktree", "add", "--detach", str(tree), sha)
    try:
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=repo, check=False)
        shutil.rmtree(parent, ignore_errors=True)


def revision_venv(tree: Path, log: Path) -> Path:
    """A venv with the revision's dependencies (built once per pyproject.toml) and its code;
    pip's output goes to `log`."""
    key = hashlib.sha256((tree / "pyproject.toml").read_bytes()).hexdigest()[:16]
    venv = ROOT / "venvs" / key
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    with log.open("w") as sink:

        def run(cmd: list[str]) -> None:
            if subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT).returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{log.read_text()[-3000:]}")

        if not (venv / ".installed").is_file():
            _say(f"building the revision's venv in {venv} (once per pyproject.toml; minutes)")
            shutil.rmtree(venv, ignore_errors=True)
            run([sys.executable, "-m", "venv", str(venv)])
            # As the Makefile does: torch first, pinned to this venv's: pip takes the CPU wheel.
            run([*pip, f"torch=={_torch_version()}"])
            run([*pip, str(tree)])
            (venv / ".installed").touch()
        _say(f"installing the revision's code into its venv (log: {log})")
        run([*pip, "--no-deps", "--force-reinstall", str(tree)])
    return venv


def _torch_version() -> str:
    from importlib.metadata import version

    return version("torch").split("+")[0]


# The served setup, the same for both revisions, so that every case the suite can provoke
# runs: keys for 401 / 403 / 429, a generation profile for the task family, the admin key.
KEYS = {
    "sk-conformance": {"id": "conformance", "tenant": "conformance"},
    "sk-conformance-one": {
        "id": "conformance-one",
        "tenant": "conformance",
        "limits": {"max_concurrent_requests": 1},
    },
    "sk-conformance-other-model": {
        "id": "conformance-other-model",
        "tenant": "conformance",
        "models": ["some-other-model"],
    },
}
ADMIN_KEY = "sk-conformance-admin"
PROFILE = {
    "name": "conformance_text",
    "instructions": "You answer customers briefly.",
    "default_max_output_tokens": 16,
    "max_output_tokens": 400,
}


def knows_fault_injection(tree: Path) -> bool:
    return "fault_injection" in (tree / "serve_app" / "config" / "options.py").read_text()


def served_setup(out: Path, faults: bool) -> tuple[list[str], Target]:
    """The `serve` flags of one side (its config and keys files, its own data folder) and the
    suite's keys; the target's URLs are filled in by the caller."""
    import yaml

    keys = out.with_suffix(".keys.yaml")
    # The keys file's form (docs/access.md): each key by its sha256, never in clear. The suite
    # is a client and imports nothing of the service.
    entries = [{"sha256": hashlib.sha256(k.encode()).hexdigest(), **e} for k, e in KEYS.items()]
    keys.write_text(yaml.safe_dump({"keys": entries}))
    config = {
        "admin_api_key": ADMIN_KEY,
        "generations": {"data_dir": str(out.with_suffix(".data")), "profiles": [PROFILE]},
    }
    if faults:
        config["fault_injection"] = True
    path = out.with_suffix(".config.yaml")
    path.write_text(yaml.safe_dump(config))
    target = Target(
        "",
        api_key="sk-conformance",
        admin_key=ADMIN_KEY,
        limited_key="sk-conformance-one",
        restricted_key="sk-conformance-other-model",
    )
    return ["--config", str(path), "--api-keys", str(keys)], target


def serve_and_run(
    command: list[str], cwd: Path, model: Path, out: Path, fast: bool, faults: bool
) -> Record:
    """Serve `model` with `command` (a `serve-app`) on free ports, run the suite, stop."""
    port, admin_port = _free_port(), _free_port()
    log = out.with_suffix(".server.log")
    flags, keyed = served_setup(out, faults)
    serve = [*command, "serve", "--model", str(model), "--port", str(port)]
    serve += ["--admin-port", str(admin_port), *flags]
    _say(f"serving {cwd} on port {port} (log: {log})")
    with log.open("w") as sink:
        # Its own process group: the stop below reaches the server and nothing else.
        proc = subprocess.Popen(
            serve, cwd=cwd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, proc, log)
            admin = f"http://127.0.0.1:{admin_port}"
            target = dataclasses.replace(keyed, base_url=url, admin_url=admin)
            record = run_suite(target, select(fast=fast))
        finally:
            _stop(proc)
    record.save(out.with_suffix(".json"))
    counts = ", ".join(f"{n} {v}" for v, n in record.counts().items())
    _say(f"{len(record.cases)} cases in {record.duration_s:.0f} s: {counts}")
    return record


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"the server was not healthy within {START_TIMEOUT_S:.0f} s (see {log})")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    raise SystemExit(main())
