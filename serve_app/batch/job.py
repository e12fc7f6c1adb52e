"""Offline batch inference over Parquet on Ray Data: `serve-app batch` and `run_batch`.

    read_parquet -> [resume: drop ids already done] -> map_batches(BatchEngine actor pool,
    each committing its rows into OUTPUT_DIR as they finish) -> compact -> summary

The driver starts the pipeline on a thread and watches it: it draws progress from the job
board (batch_board.py) and turns the first SIGINT/SIGTERM into a stop order (batch_stop.py).

Resume keeps no state of its own: the output directory is the checkpoint. Engines commit
each finished row within `--commit-interval-s` (and every engine call's rows when it ends),
each file whole (temporary name, fsync, rename), so what a killed job had finished is on disk
and what it had not is not. `--resume` reads the id, status, error_code and attempt columns
back, keeps every final row (completed, incomplete, failed for a reason in the row) and runs
the rest: ids with no row, and transient failures, whose new row carries attempt + 1.
Compaction then merges the files into one row per input id, the latest attempt.
Ray Data's own id-column checkpointing (beta) is not used: it would count a transient failure
as done, and it keeps a second record beside the output that could disagree with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa

from serve_app.batch.commit import DEFAULT_COMMIT_INTERVAL_S, CommitPlan
from serve_app.batch.faults import FaultHook, kill_points_from_env
from serve_app.batch.job_board import REPORT_INTERVAL_S, Counts, JobBoard, Snapshot
from serve_app.batch.parquet_io import (
    BatchInputError,
    InputSource,
    OutputDir,
    compact,
    is_transient,
    read_input_ids,
    remove_temporaries,
    resolve_input,
    scan_results,
)
from serve_app.batch.pipeline import EngineSpec, PipelineThread, build_dataset, ray_data_output
from serve_app.batch.progress import ProgressView
from serve_app.batch.rows import BatchDefaults
from serve_app.batch.stop import StopSignals, exit_status

logger = logging.getLogger(__name__)

__all__ = ["BatchDefaults", "BatchInputError", "BatchJobError", "BatchSummary", "run_batch"]

# Rows per engine call: a larger batch keeps the engine full for longer (fewer tails where a
# few long rows run alone); a killed job loses only rows still running or not yet committed.
DEFAULT_BATCH_SIZE = 256
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_PROGRESS_INTERVAL_S = 10.0
# After a stop, how much longer than the drain timeout the driver waits for engines to end
# their calls (an abort lands between steps; one step can be long) before it stops waiting.
STOP_GRACE_S = 30.0


class BatchJobError(RuntimeError):
    """The pipeline failed (an engine actor died, ...): what was committed stays on disk."""


@dataclass(frozen=True)
class BatchSummary:
    output_dir: str
    num_rows: int  # input rows; after compaction the output has at most one per id
    num_completed: int
    num_incomplete: int
    num_failed: int
    num_retryable: int  # failed rows that `--resume` would run again
    num_missing: int  # input ids without a row: `--resume` runs them
    num_kept: int  # rows kept from an earlier run
    num_run: int  # rows this run generated and committed
    prompt_tokens: int  # this run
    completion_tokens: int  # this run
    elapsed_s: float  # this run's pipeline
    stopped_by: str | None = None  # the signal that stopped the job early, if one did

    @property
    def output_tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def num_left(self) -> int:
        """Rows without a final result: what `--resume` would run."""
        return self.num_missing + self.num_retryable

    @property
    def exit_status(self) -> int:
        import signal

        return exit_status(signal.Signals[self.stopped_by]) if self.stopped_by else 0

    def __str__(self) -> str:
        retry = f" ({self.num_retryable} transient: --resume runs them again)"
        stopped = f" (stopped by {self.stopped_by})" if self.stopped_by else ""
        shown = self.num_left or self.stopped_by
        left = f"  left for --resume: {self.num_left} rows{stopped}\n" if shown else ""
        return (
            f"batch: {self.num_rows} rows -> {self.output_dir}\n"
            f"  completed {self.num_completed}, incomplete {self.num_incomplete}, "
            f"failed {self.num_failed}{retry if self.num_retryable else ''}\n"
            f"{left}"
            f"  this run: {self.num_run} rows generated, {self.num_kept} kept from earlier runs, "
            f"{self.completion_tokens} output tokens in {self.elapsed_s:.1f}s "
            f"({self.output_tokens_per_s:.1f} tokens/s)"
        )


@dataclass(frozen=True)
class _Plan:
    done: list[str]  # input ids whose existing row is final
    attempts: dict[str, int]  # ids to run again -> their latest attempt so far
    num_todo: int


def run_batch(
    input: InputSource,
    output_dir: str | os.PathLike,
    *,
    model: str | os.PathLike,
    tp: int = 1,
    concurrency: int = 1,
    resume: bool = False,
    defaults: BatchDefaults | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    cpus_per_engine: int = 1,
    model_name: str | None = None,
    engine_options: dict[str, Any] | None = None,
    address: str | None = None,
    commit_interval_s: float = DEFAULT_COMMIT_INTERVAL_S,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
    verbose: bool = False,
) -> BatchSummary:
    """Run every input row through the model; one output row per input id in `output_dir`.

    Input problems (no `id` column, duplicate ids, results already in `output_dir` without
    `resume`) raise BatchInputError before any work. Bad rows do not: they become `failed`
    output rows with an error code, and the job goes on. A first SIGINT/SIGTERM stops the job
    early (`stopped_by` in the summary); a failed pipeline raises BatchJobError after the
    summary is printed.
    """
    _check_sizes(tp=tp, concurrency=concurrency, batch_size=batch_size,
                 cpus_per_engine=cpus_per_engine)  # fmt: skip
    for name, value in {"commit_interval_s": commit_interval_s,
                        "drain_timeout_s": drain_timeout_s}.items():  # fmt: skip
        if not isinstance(value, int | float) or value < 0:
            raise ValueError(f"{name} must be a number of seconds >= 0 (got {value!r})")
    with StopSignals(drain_timeout_s) as signals:
        files = resolve_input(input)
        ids = read_input_ids(files)
        model = str(Path(model).resolve())  # absolute: the actors' working directory differs
        _check_model(model, tp)
        out = OutputDir.open(output_dir)
        kills = kill_points_from_env()
        plan = _plan(out, ids, resume)
        spec = EngineSpec(model, concurrency, batch_size, cpus_per_engine, tp, {
            "tensor_parallel_size": tp, "defaults": defaults or BatchDefaults(),
            "num_threads": cpus_per_engine if tp == 1 else 1, "model_name": model_name,
            "engine_options": engine_options, "kills": kills,
        })  # fmt: skip
        counts, elapsed, error = Counts(), 0.0, None
        if plan.num_todo and signals.signum is None:
            started_ray = _ensure_ray(address)
            signals.install()
            try:
                job = _Job(files, out, plan, spec, signals, commit_interval_s, len(ids))
                counts, elapsed, error = job.run(progress_interval_s, verbose)
            finally:
                if started_ray:
                    _shutdown_ray()
        faults = FaultHook(kills)
        compact(out, on_written=lambda: faults.reached("compact"))
        summary = _summarize(out, ids, len(plan.done), counts, elapsed, signals.name)
    print(summary, flush=True)
    if error is not None:
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise BatchJobError(f"the pipeline failed: {first_line}") from error
    return summary


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")


def _check_model(model: str, tp: int) -> None:
    """Fail here, naming the problem, rather than in every engine actor's constructor. The
    config is only read (no dtype): the driver never imports torch."""
    from actors.config import ModelConfig, check_tensor_parallel

    if not (Path(model) / "config.json").is_file():
        raise BatchInputError(f"model: {model} has no config.json")
    try:
        config = ModelConfig.from_pretrained(model, dtype=None)
    except (KeyError, ValueError) as exc:
        raise BatchInputError(f"model: {model}: {exc}") from None
    check_tensor_parallel(config, tp)


def _plan(out: OutputDir, ids: pa.Array, resume: bool) -> _Plan:
    existing = scan_results(out)
    if existing and not resume:
        raise BatchInputError(
            f"output_dir: {out.path} already holds results; pass --resume to continue that "
            "job, or choose an empty directory"
        )
    remove_temporaries(out)  # left by writers killed mid-write
    wanted = set(ids.to_pylist())
    done: list[str] = []
    attempts: dict[str, int] = {}
    for rid, rows in existing.items():
        if rid not in wanted:
            continue
        latest = rows[0]
        if is_transient(latest.status, latest.error_code):
            attempts[rid] = latest.attempt
        else:
            done.append(rid)
    strays = len(existing.keys() - wanted)
    if strays:
        logger.warning("%s holds %d id(s) that are not in this input; kept", out.path, strays)
    return _Plan(done, attempts, len(wanted) - len(done))


def _ensure_ray(address: str | None) -> bool:
    """Join the cluster named, or start a local Ray; whether this call started one."""
    joining = bool(address or os.environ.get("RAY_ADDRESS"))
    if not joining and "ray" not in sys.modules:
        # A new local Ray turns token auth on and warns so at every start unless
        # RAY_AUTH_MODE says it; Ray reads the variable when it is imported (as
        # serve_app.server.choose_local_auth_mode does for `serve-app serve`).
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    if ray.is_initialized():
        return False
    if joining:
        # `ray job submit` sets RAY_ADDRESS for its driver.
        ray.init(address=address, logging_level=logging.WARNING)
        return False
    ray.init(
        address="local",
        num_cpus=max(8, os.cpu_count() or 1),
        include_dashboard=False,
        logging_level=logging.WARNING,  # not "Started a local Ray instance."
    )
    return True


def _shutdown_ray() -> None:
    import ray

    ray.shutdown()


class _Job:
    """One run of the pipeline, watched from the main thread: progress, and the stop."""

    def __init__(
        self,
        files: Any,
        out: OutputDir,
        plan: _Plan,
        spec: EngineSpec,
        signals: StopSignals,
        commit_interval_s: float,
        num_rows: int,
    ):
        self.files, self.out, self.plan, self.spec = files, out, plan, spec
        self.signals = signals
        self.commit_interval_s = commit_interval_s
        self.num_rows = num_rows

    def run(self, progress_interval_s: float, verbose: bool) -> tuple[Counts, float, Any]:
        import ray

        board = ray.remote(num_cpus=0)(JobBoard).remote()
        run_id = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
        commit = CommitPlan(self.out.uri, run_id, self.commit_interval_s)
        engine_kwargs = {**self.spec.engine_kwargs, "commit": commit, "board": board}
        spec = replace(self.spec, engine_kwargs=engine_kwargs)
        started = time.perf_counter()
        with ray_data_output(verbose):
            dataset = build_dataset(self.files, self.out, self.plan.done, self.plan.attempts, spec)
            pipeline = PipelineThread(dataset)
            pipeline.start()
            view = ProgressView(self.num_rows, len(self.plan.done), interval_s=progress_interval_s)
            try:
                snapshot = self._watch(board, pipeline, view)
            finally:
                view.close()
        elapsed = time.perf_counter() - started
        error = pipeline.error if self.signals.signum is None else None
        # After a stop the pipeline may still be running out its input (each call returns at
        # once): its engines still ask the board, so it goes when the pipeline ends.
        threading.Thread(target=_kill_after, args=(board, pipeline), daemon=True).start()
        return snapshot.counts, elapsed, error

    def _watch(self, board: Any, pipeline: PipelineThread, view: ProgressView) -> Snapshot:
        import ray

        stop_sent: float | None = None
        while True:
            if stop_sent is None:
                self.signals.stopping.wait(timeout=REPORT_INTERVAL_S)  # a signal wakes it
            else:
                pipeline.join(timeout=REPORT_INTERVAL_S)
            if self.signals.signum is not None and stop_sent is None:
                board.request_stop.remote(self.signals.drain_timeout_s)
                stop_sent = time.monotonic()
            snapshot: Snapshot = ray.get(board.snapshot.remote())
            view.update(snapshot.counts)
            if not pipeline.is_alive():
                return snapshot
            if stop_sent is None:
                continue
            # Each engine learns of the stop at its next post; once none is inside a call,
            # none will commit again (a call that starts now sees the stop and returns).
            if snapshot.num_busy == 0:
                return snapshot
            waited = time.monotonic() - stop_sent
            if waited > self.signals.drain_timeout_s + STOP_GRACE_S:
                logger.warning("engines still busy %.0fs after the stop; not waiting", waited)
                return snapshot


def _kill_after(board: Any, pipeline: PipelineThread) -> None:
    import ray

    pipeline.join()
    # Ray may be shut down already, and the board with it.
    with contextlib.suppress(Exception):
        ray.kill(board)


def _summarize(
    out: OutputDir,
    ids: pa.Array,
    num_kept: int,
    counts: Counts,
    elapsed: float,
    stopped_by: str | None,
) -> BatchSummary:
    rows = scan_results(out)
    latest = [rows[rid][0] for rid in ids.to_pylist() if rid in rows]
    statuses = [r.status for r in latest]
    return BatchSummary(
        output_dir=out.uri,
        num_rows=len(ids),
        num_completed=statuses.count("completed"),
        num_incomplete=statuses.count("incomplete"),
        num_failed=statuses.count("failed"),
        num_retryable=sum(is_transient(r.status, r.error_code) for r in latest),
        num_missing=len(ids) - len(latest),
        num_kept=num_kept,
        num_run=counts.num_committed,
        prompt_tokens=counts.committed_prompt_tokens,
        completion_tokens=counts.committed_completion_tokens,
        elapsed_s=elapsed,
        stopped_by=stopped_by,
    )
