"""The engine's own CPU kernels (`actors/csrc/`), built with the machine's compiler on first use.

The library is compiled once per (source, torch, compiler, CPU) into a cache folder and loaded
as torch operators (`torch.ops.serve_app.*`). Several processes starting at once build it once:
the build holds a file lock and lands by rename. Anything that fails (no compiler, headers
missing, a CPU the flags do not fit) leaves the engine on torch's own ops, logged once.

    python -m actors.layers.kernels      # build now (make venv does), print the library path
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = (
    CSRC / "paged_attention.cpp",
    CSRC / "fused_ops.cpp",
    CSRC / "prefill_attention.cpp",
    CSRC / "panel_linear.cpp",
)
HEADERS = (CSRC / "vec_math.h",)
# -march=native: the library is built on the machine that runs it, for the vector units it has.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++20", "-shared", "-fPIC", "-w")
CACHE_ENV = "SERVE_APP_KERNEL_CACHE"
COMPILER_ENV = "CXX"

_lock = threading.Lock()
_loaded: bool | None = None


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "serve-app" / "kernels"
    return Path(os.environ.get(CACHE_ENV, default))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _build_key(compiler: str) -> str:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    digest = hashlib.sha256()
    for part in (torch.__version__, version, " ".join(FLAGS), platform.machine(), _cpu_flags()):
        digest.update(part.encode())
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:20]


def _compile(compiler: str, out: Path) -> None:
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = cpp_extension.library_paths()
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    command = [
        compiler,
        *FLAGS,
        abi,
        *includes,
        *map(str, SOURCES),
        "-o",
        str(out),
        *[f"-L{p}" for p in libs],
        *[f"-Wl,-rpath,{p}" for p in libs],
        "-lc10",
        "-ltorch_cpu",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")


def build() -> Path:
    """The library's path, compiling it first if this machine has no build of these sources."""
    compiler = os.environ.get(COMPILER_ENV) or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    folder = cache_dir() / _build_key(compiler)
    library = folder / "serve_app_kernels.so"
    if library.is_file():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not library.is_file():  # another process may have built it while we waited
            partial = folder / f".building-{os.getpid()}.so"
            try:
                _compile(compiler, partial)
                os.replace(partial, library)
            finally:
                partial.unlink(missing_ok=True)
    return library


def available() -> bool:
    """Whether the kernels are loaded into this process (building them on the first call)."""
    global _loaded
    with _lock:
        if _loaded is None:
            try:
                torch.ops.load_library(str(build()))  # the same file twice loads it once
                _loaded = True
            except Exception as exc:  # noqa: BLE001 (any failure keeps torch's own ops)
                logger.warning("CPU kernels unavailable, using torch's ops: %s", exc)
                _loaded = False
        return _loaded


if __name__ == "__main__":
    path = build()
    print(path)
    sys.exit(0 if available() else 1)
