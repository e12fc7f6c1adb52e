"""Offline batch inference over Parquet on Ray Data: `serve-app batch` and `run_batch`.

    read_parquet -> [resume: drop ids already done] -> map_batches(BatchEngine actor pool)
    -> write_parquet(OUTPUT_DIR) -> compact -> summary

Resume keeps no state of its own: the output directory is the checkpoint. Ray Data writes
each finished batch as its own Parquet file, so what a killed job had finished is on disk and
what it had not is not (a file cut short by the kill is moved aside and its rows run again).
`--resume` reads the id, status, error_code and attempt columns back, keeps every final row
(completed, incomplete, failed for a reason in the row) and runs the rest: ids with no row,
and transient failures, whose new row carries attempt + 1. Compaction then drops rows that a
later attempt superseded, so the output has one row per input id, the latest attempt.
Ray Data's own id-column checkpointing (beta) is not used: it would count a transient failure
as done, and it keeps a second record beside the output that could disagree with it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from serve_app.batch_io import (
    STATUSES,
    BatchInputError,
    InputFiles,
    InputSource,
    OutputDir,
    compact,
    is_transient,
    read_input_ids,
    read_results,
    resolve_input,
    scan_results,
)
from serve_app.batch_rows import BatchDefaults

logger = logging.getLogger(__name__)

__all__ = ["BatchDefaults", "BatchInputError", "BatchSummary", "run_batch"]

# Rows per engine call: a larger batch keeps the engine full for longer (fewer tails where a
# few long rows run alone), a smaller one loses less work when a job is killed.
DEFAULT_BATCH_SIZE = 256

# Ray Data's Parquet reader reads the files' footers on a pool of actors, each a worker
# process of its own, 32 of them whatever the number of files. On 2 cores a one-file job spent
# ~5 s of its 12 s start-up starting them (measured, `bench` checkpoint): the job sizes the
# pool to its files instead (one actor per 10, as many as the reader's footer batch holds),
# unless the operator set the variable.
FOOTER_ACTORS_ENV = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"
FILES_PER_FOOTER_ACTOR = 10
MAX_FOOTER_ACTORS = 32


@dataclass(frozen=True)
class BatchSummary:
    output_dir: str
    num_rows: int  # input rows; the output has exactly one per id
    num_completed: int
    num_incomplete: int
    num_failed: int
    num_retryable: int  # failed rows that `--resume` would run again
    num_kept: int  # rows kept from an earlier run
    num_run: int  # rows this run generated
    prompt_tokens: int  # this run
    completion_tokens: int  # this run
    elapsed_s: float  # this run's pipeline

    @property
    def output_tokens_per_s(self) -> float:
        return self.completion_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def __str__(self) -> str:
        retry = f" ({self.num_retryable} transient: --resume runs them again)"
        return (
            f"batch: {self.num_rows} rows -> {self.output_dir}\n"
            f"  completed {self.num_completed}, incomplete {self.num_incomplete}, "
            f"failed {self.num_failed}{retry if self.num_retryable else ''}\n"
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
) -> BatchSummary:
    """Run every input row through the model; one output row per input id in `output_dir`.

    Input problems (no `id` column, duplicate ids, results already in `output_dir` without
    `resume`) raise BatchInputError before any work. Bad rows do not: they become `failed`
    output rows with an error code, and the job goes on.
    """
    sizes = {"tp": tp, "concurrency": concurrency, "batch_size": batch_size}
    for name, value in {**sizes, "cpus_per_engine": cpus_per_engine}.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
    files = resolve_input(input)
    ids = read_input_ids(files)
    model = str(Path(model).resolve())  # absolute: the actors' working directory differs
    _check_model(model, tp)
    out = OutputDir.open(output_dir)
    plan = _plan(out, ids, resume)
    before = set(out.result_files())
    elapsed = 0.0
    if plan.num_todo:
        _ensure_ray(address)
        started = time.perf_counter()
        _execute(
            files,
            out,
            plan,
            model=model,
            concurrency=concurrency,
            batch_size=batch_size,
            cpus_per_engine=cpus_per_engine,
            engine_kwargs={
                "tensor_parallel_size": tp,
                "defaults": defaults or BatchDefaults(),
                "num_threads": cpus_per_engine if tp == 1 else 1,
                "model_name": model_name,
                "engine_options": engine_options,
            },
        )
        elapsed = time.perf_counter() - started
    compact(out)
    summary = _summarize(out, ids, before, len(plan.done), elapsed)
    print(summary, flush=True)
    return summary


def _check_model(model: str, tp: int) -> None:
    """Fail here, naming the problem, rather than in every engine actor's constructor."""
    import torch

    from actors.config import ModelConfig, check_tensor_parallel

    if not (Path(model) / "config.json").is_file():
        raise BatchInputError(f"model: {model} has no config.json")
    try:
        config = ModelConfig.from_pretrained(model, dtype=torch.float32)
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


def _ensure_ray(address: str | None) -> None:
    import ray

    if ray.is_initialized():
        return
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address)  # `ray job submit` sets RAY_ADDRESS for its driver
    else:
        ray.init(address="local", num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False)


def _select_todo(batch: pa.Table, done: pa.Array, attempts: dict[str, int]) -> pa.Table:
    """Drop rows already done; number the attempt of the rest (a Ray Data task)."""
    batch = batch.filter(pc.invert(pc.is_in(batch.column("id").cast(pa.string()), done)))
    numbers = [attempts.get(rid, 0) + 1 for rid in batch.column("id").to_pylist()]
    return batch.append_column("_attempt", pa.array(numbers, pa.int32()))


def _execute(
    files: InputFiles,
    out: OutputDir,
    plan: _Plan,
    *,
    model: str,
    concurrency: int,
    batch_size: int,
    cpus_per_engine: int,
    engine_kwargs: dict[str, Any],
) -> None:
    import ray
    import ray.data

    from serve_app.batch_engine import BatchEngine

    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    if nodes > 1 and "://" not in out.uri:
        logger.warning(
            "%s is a local path on a %d-node cluster: every node reads the input and writes "
            "results under it, so it must be shared storage (NFS), or use s3://...",
            out.uri,
            nodes,
        )
    with _footer_readers(len(files.paths)):
        ds = ray.data.read_parquet(files.paths, filesystem=files.filesystem)
    if plan.done or plan.attempts:
        ds = ds.map_batches(
            _select_todo,
            batch_format="pyarrow",
            batch_size=None,
            fn_kwargs={"done": pa.array(plan.done, pa.string()), "attempts": plan.attempts},
        )
    tp = engine_kwargs["tensor_parallel_size"]
    # With TP the ranks hold the GPUs (in the executor's placement group); without, the
    # engine runs in this actor and needs the GPU itself.
    has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    ds = ds.map_batches(
        BatchEngine,
        fn_constructor_args=(model,),
        fn_constructor_kwargs=engine_kwargs,
        compute=ray.data.ActorPoolStrategy(size=concurrency),
        batch_size=batch_size,
        batch_format="pyarrow",
        num_cpus=cpus_per_engine,
        num_gpus=1 if has_gpus and tp == 1 else 0,
    )
    ds.write_parquet(out.uri)


@contextmanager
def _footer_readers(num_files: int) -> Iterator[None]:
    """Size the footer-reader pool of a `read_parquet` made inside (it reads the variable
    when the dataset is planned, in this process)."""
    if FOOTER_ACTORS_ENV in os.environ:
        yield
        return
    wanted = math.ceil(num_files / FILES_PER_FOOTER_ACTOR)
    os.environ[FOOTER_ACTORS_ENV] = str(max(1, min(MAX_FOOTER_ACTORS, wanted)))
    try:
        yield
    finally:
        os.environ.pop(FOOTER_ACTORS_ENV, None)


def _summarize(
    out: OutputDir, ids: pa.Array, before: set[str], num_kept: int, elapsed: float
) -> BatchSummary:
    table = read_results(out)
    table = table.filter(pc.is_in(table.column("id"), ids))
    statuses = table.column("status").to_pylist()
    codes = table.column("error_code").to_pylist()
    counts = {s: statuses.count(s) for s in STATUSES}
    new_files = [p for p in out.result_files() if p not in before]
    new = [t for t in (out.read(p) for p in new_files) if t is not None]
    prompt = sum(pc.sum(t.column("prompt_tokens")).as_py() or 0 for t in new)
    completion = sum(pc.sum(t.column("completion_tokens")).as_py() or 0 for t in new)
    return BatchSummary(
        output_dir=out.uri,
        num_rows=len(ids),
        num_completed=counts["completed"],
        num_incomplete=counts["incomplete"],
        num_failed=counts["failed"],
        num_retryable=sum(is_transient(s, c) for s, c in zip(statuses, codes, strict=True)),
        num_kept=num_kept,
        num_run=sum(t.num_rows for t in new),
        prompt_tokens=prompt,
        completion_tokens=completion,
        elapsed_s=elapsed,
    )
