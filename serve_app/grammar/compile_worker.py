"""The grammar compiler's processes: a zygote that imports xgrammar once, and the workers it
forks, each compiling one grammar at a time.

Run as `python -m serve_app.grammar.compile_worker FD` by `CompilePool`, FD being the zygote's
end of a Unix socket pair with the pool. The pool first sends the setup (tokenizer info as
`TokenizerInfo.serialize_json()`, threads per compile), then one message per worker wanted,
carrying the worker's own socket. Forking a process that has imported xgrammar costs ~60 ms
where a fresh interpreter costs seconds (torch and transformers come with it), so a worker
killed for a runaway compile is replaced at once. The zygote itself never compiles: it stays
single-threaded, so forking it is safe.

A worker answers each `CompileJob` with a `CompileResult`. Anything xgrammar prints as a
`Warning:` while compiling means it would enforce less than the spec says (a dropped keyword,
an ignored regex anchor, a remote `$ref` read as "any JSON"): the worker refuses the grammar
with that warning instead of returning it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from serve_app.grammar.spec import GrammarError

# xgrammar's log lines: "[hh:mm:ss] /path/file.cc:NN: Warning: text".
_WARNING = re.compile(r"\.cc:\d+: Warning: (.*)")


@dataclass(frozen=True)
class CompileJob:
    kind: str  # a GrammarSpec kind (serve_app.grammar.spec)
    canonical: str
    delay_s: float = 0.0  # fault injection: the compile takes this much longer


@dataclass(frozen=True)
class CompileResult:
    serialized: str | None  # CompiledGrammar.serialize_json(); None when refused
    error: str = ""  # xgrammar's message (raw: the service cleans it) or its warning


def compile_serialized(compiler: Any, kind: str, canonical: str) -> str:
    """The grammar for a canonical spec, as `serialize_json()` text."""
    if kind == "regex":
        return compiler.compile_regex(canonical).serialize_json()
    if kind == "ebnf":
        return compiler.compile_grammar(canonical).serialize_json()
    from serve_app.grammar.convert import spec_ebnf

    return compiler.compile_grammar(spec_ebnf(kind, canonical)).serialize_json()


def run_job(compiler: Any, job: CompileJob) -> CompileResult:
    """Compile with fd 2 captured: the worker runs one job at a time, so every line xgrammar
    logs meanwhile belongs to this grammar."""
    if job.delay_s:
        time.sleep(job.delay_s)
    with tempfile.TemporaryFile() as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            serialized = compile_serialized(compiler, job.kind, job.canonical)
            error = ""
        except (RuntimeError, ValueError, TypeError, GrammarError) as exc:  # xgrammar's, ours
            serialized, error = None, str(exc) or type(exc).__name__
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        logged = captured.read().decode(errors="replace")
    warnings = _WARNING.findall(logged)
    if serialized is not None and warnings:
        reason = f"not enforced exactly by the grammar backend ({warnings[0].strip()})"
        return CompileResult(None, reason)
    return CompileResult(serialized, error)


def serve_worker(conn: Connection, info: Any, max_threads: int) -> None:
    import xgrammar as xgr

    # The service keeps the cache: a worker may be killed at any time.
    compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # the pool closed or died: nothing left to do
            return
        conn.send(run_job(compiler, job))


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits (a worker stuck in a compile would
    otherwise outlive the service until the compile ends)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the socket's EOF still ends them
        pass


def zygote_main(fd: int) -> None:
    die_with_parent()
    import xgrammar as xgr

    zygote = socket.socket(fileno=fd)
    setup = _recv_setup(zygote)
    info = xgr.TokenizerInfo.deserialize_json(setup["tokenizer_info"])
    max_threads = int(setup["max_threads"])
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped without waiting
    zygote.sendall(b"R")  # ready to fork
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(zygote, 16, 1)
        except OSError:
            return
        if not message or not fds:  # the pool closed its end
            return
        if os.fork() == 0:
            zygote.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            die_with_parent()
            try:
                serve_worker(Connection(fds[0]), info, max_threads)
            finally:
                os._exit(0)
        os.close(fds[0])


def _recv_setup(zygote: socket.socket) -> dict[str, Any]:
    header = _recv_exactly(zygote, 8)
    return json.loads(_recv_exactly(zygote, int.from_bytes(header, "big")))


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, remaining = [], size
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            sys.exit(0)
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


if __name__ == "__main__":
    # By its package name, so the messages it pickles name that module, not `__main__`.
    from serve_app.grammar.compile_worker import zygote_main as main

    main(int(sys.argv[1]))
