"""Running a snippet in a fresh interpreter: what a new process (a replica, a rank) imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, timeout_s: float = 120) -> str:
    """`code` run by this interpreter in a new process at the repository root; its stdout,
    stripped. Fails the test with its stderr when it exits non-zero."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()
