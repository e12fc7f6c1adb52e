"""A pool of grammar-compiling processes that a runaway compile cannot hold.

xgrammar's compile threads cannot be stopped, so compiles run in worker processes (forked by
the zygote in `compile_worker`), one job at a time each. A compile's timeout counts from the
moment a worker takes it, never from the queue; a worker that runs past it is killed and
replaced, so the slot is free again within about a fork (~60 ms). A compile that finds every
worker busy waits in a bounded queue; when the queue is full, or a job has waited longer than
`max_queue_wait_s` while every worker was busy compiling, it is refused as `PoolSaturated`
(the service answers 503 `overloaded`): an overload is never reported as the spec's fault.

Plain threads and processes, no Ray: one supervisor thread per worker sends it jobs and kills
it on timeout. Results cross as `CompiledGrammar.serialize_json()` text, as they cross Ray.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from serve_app.grammar.compile_worker import CompileJob, CompileResult

logger = logging.getLogger(__name__)

# A worker or the zygote that is not ready within this long is started again.
START_TIMEOUT_S = 120.0


class PoolSaturated(Exception):
    """Every worker is busy and the queue is full, or the wait for a worker ran too long."""


class CompileTimeout(Exception):
    """The compile ran its whole timeout on a worker of its own (the worker was killed)."""


class CompileCrashed(Exception):
    """The worker died while compiling this grammar (a crash in the grammar backend)."""


class CompileRefused(Exception):
    """The backend refused the grammar; the text is xgrammar's message, not yet cleaned."""


class PoolClosed(Exception):
    pass


@dataclass
class PoolJob:
    job: CompileJob
    future: Future[str] = field(default_factory=Future)
    enqueued_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None


class _Zygote:
    """The process that forks workers; restarted by whichever slot finds it gone."""

    def __init__(self, tokenizer_info_json: str, threads_per_worker: int):
        self._setup = json.dumps(
            {"tokenizer_info": tokenizer_info_json, "max_threads": threads_per_worker}
        ).encode()
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None

    def fork_worker(self) -> tuple[Connection, int]:
        """A new worker's connection and pid, once it is ready to compile."""
        ours, theirs = socket.socketpair()
        try:
            with self._lock:
                sock = self._ensure_running()
                try:
                    socket.send_fds(sock, [b"F"], [theirs.fileno()])
                except OSError:
                    self._stop_locked()
                    raise
        finally:
            theirs.close()
        conn = Connection(ours.detach())
        if not conn.poll(START_TIMEOUT_S):
            conn.close()
            raise OSError("grammar worker did not start")
        message, pid = conn.recv()
        assert message == "ready"
        return conn, pid

    def stop(self) -> None:
        with self._lock:
            self._stop_locked()

    def _ensure_running(self) -> socket.socket:
        if self._proc is not None and self._proc.poll() is None and self._sock is not None:
            return self._sock
        self._stop_locked()
        ours, theirs = socket.socketpair()
        # A fresh interpreter, not a fork of this multi-threaded process; argv names its socket.
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, _pythonpath()])))
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "serve_app.grammar.compile_worker", str(theirs.fileno())],
            stdin=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),),
            env=env,
        )
        theirs.close()
        ours.sendall(len(self._setup).to_bytes(8, "big") + self._setup)
        ours.settimeout(START_TIMEOUT_S)
        if ours.recv(1) != b"R":
            ours.close()
            raise OSError("grammar zygote did not start")
        ours.settimeout(None)
        self._sock = ours
        return ours

    def _stop_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()  # the zygote exits when its socket closes
            self._sock = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None


def _pythonpath() -> str:
    return os.environ.get("PYTHONPATH", "")


class CompilePool:
    def __init__(
        self,
        tokenizer_info_json: str,
        *,
        num_workers: int,
        timeout_s: float,
        max_queue: int,
        max_queue_wait_s: float,
        threads_per_worker: int = 1,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.timeout_s = timeout_s
        self.max_queue = max_queue
        self.max_queue_wait_s = max_queue_wait_s
        self._zygote = _Zygote(tokenizer_info_json, threads_per_worker)
        self._queue: collections.deque[PoolJob] = collections.deque()
        self._cond = threading.Condition()
        self._num_busy = 0  # workers compiling a job now
        self._num_ready = 0  # workers started and alive
        self._closed = False
        self.num_killed = 0
        self.num_crashed = 0
        self._pids: set[int] = set()  # live workers
        self._busy_pids: set[int] = set()
        self._threads = [
            threading.Thread(target=self._supervise, name=f"grammar-worker-{i}", daemon=True)
            for i in range(num_workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: CompileJob) -> PoolJob:
        """Queue a compile; raises PoolSaturated when every worker is busy and the queue full."""
        with self._cond:
            if self._closed:
                raise PoolClosed("the grammar compiler is shutting down")
            idle = self._num_ready - self._num_busy
            if len(self._queue) >= max(idle, 0) + self.max_queue:
                raise PoolSaturated(f"the compile queue is full ({len(self._queue)} waiting)")
            pool_job = PoolJob(job)
            self._queue.append(pool_job)
            self._cond.notify()
            return pool_job

    def expire(self, pool_job: PoolJob) -> bool:
        """Refuse a job still waiting for a worker while every worker is busy compiling (or
        none could start at all); True if it was refused."""
        with self._cond:
            if pool_job.started_at is not None or pool_job not in self._queue:
                return False
            waited = time.monotonic() - pool_job.enqueued_at
            saturated = self._num_ready > 0 and self._num_busy >= self._num_ready
            if not (saturated or waited > START_TIMEOUT_S):
                return False
            self._queue.remove(pool_job)
        reason = f"waited {waited:.1f}s for a grammar compiler; all are busy"
        pool_job.future.set_exception(PoolSaturated(reason))
        return True

    def worker_pids(self) -> list[int]:
        with self._cond:
            return sorted(self._pids)

    def busy_pids(self) -> list[int]:
        with self._cond:
            return sorted(self._busy_pids)

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "workers_ready": self._num_ready,
                "workers_busy": self._num_busy,
                "queued": len(self._queue),
                "workers_killed": self.num_killed,
                "workers_crashed": self.num_crashed,
            }

    def close(self) -> None:
        with self._cond:
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            pids = list(self._pids)
            self._cond.notify_all()
        for pool_job in pending:
            pool_job.future.set_exception(PoolClosed("the grammar compiler is shutting down"))
        for pid in pids:
            _kill(pid)
        self._zygote.stop()

    # ---------------------------------------------------------------- supervisor threads

    def _supervise(self) -> None:
        conn: Connection | None = None
        pid = 0
        while True:
            if conn is None:
                conn, pid = self._start_worker()
                if conn is None:
                    return  # closed
            pool_job = self._take(pid)
            if pool_job is None:
                conn.close()
                return
            try:
                alive = self._run(conn, pid, pool_job)
            finally:
                with self._cond:
                    self._num_busy -= 1
                    self._busy_pids.discard(pid)
            if not alive:
                conn.close()
                conn = None
                with self._cond:
                    self._num_ready -= 1
                    self._pids.discard(pid)

    def _start_worker(self) -> tuple[Connection | None, int]:
        backoff = 0.1
        while not self._closed:
            try:
                conn, pid = self._zygote.fork_worker()
            except (OSError, EOFError, AssertionError) as exc:
                logger.warning("grammar worker start failed (%s); retrying", exc)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            with self._cond:
                if self._closed:
                    _kill(pid)
                    return None, 0
                self._num_ready += 1
                self._pids.add(pid)
                self._cond.notify_all()
            return conn, pid
        return None, 0

    def _take(self, pid: int) -> PoolJob | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            pool_job = self._queue.popleft()
            pool_job.started_at = time.monotonic()
            self._num_busy += 1
            self._busy_pids.add(pid)
            return pool_job

    def _run(self, conn: Connection, pid: int, pool_job: PoolJob) -> bool:
        """Run one job on the worker; False when the worker is gone (killed or crashed)."""
        future = pool_job.future
        try:
            conn.send(pool_job.job)
            if conn.poll(self.timeout_s):
                result: CompileResult = conn.recv()
            else:
                _kill(pid)
                with self._cond:
                    self.num_killed += 1
                future.set_exception(CompileTimeout(f"{self.timeout_s:g}s"))
                return False
        except (EOFError, OSError):
            with self._cond:
                self.num_crashed += 1
            logger.warning("grammar worker %d died while compiling", pid)
            future.set_exception(CompileCrashed("the grammar compiler crashed on this grammar"))
            return False
        except Exception as exc:  # noqa: BLE001 (a broken reply: replace the worker, keep serving)
            _kill(pid)
            future.set_exception(exc)
            return False
        if result.serialized is None:
            future.set_exception(CompileRefused(result.error))
        else:
            future.set_result(result.serialized)
        return True


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
