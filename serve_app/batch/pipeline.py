"""The Ray Data pipeline of a `serve-app batch` job, run on a thread of the driver.

    read_parquet -> [resume: drop ids already done] -> map_batches(BatchEngine actor pool)

Engines commit their own rows (batch_commit.py), so the pipeline's output is one small count
per engine call and the thread only drains it; the driver's main thread stays free for the
progress display and for signals. Ray Data's own progress and execution logs are off unless
`verbose`.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from serve_app.batch.parquet_io import InputFiles, OutputDir

logger = logging.getLogger(__name__)

# Ray Data's Parquet reader reads the files' footers on a pool of actors, each a worker
# process of its own, 32 of them whatever the number of files. On 2 cores a one-file job spent
# ~5 s of its 12 s start-up starting them (measured, `bench` checkpoint): the job sizes the
# pool to its files instead (one actor per 10, as many as the reader's footer batch holds),
# unless the operator set the variable.
FOOTER_ACTORS_ENV = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"
FILES_PER_FOOTER_ACTOR = 10
MAX_FOOTER_ACTORS = 32


@dataclass(frozen=True)
class EngineSpec:
    model: str
    concurrency: int
    batch_size: int
    cpus_per_engine: int
    tp: int
    engine_kwargs: dict[str, Any]  # BatchEngine's keyword arguments


def _select_todo(batch: pa.Table, done: pa.Array, attempts: dict[str, int]) -> pa.Table:
    """Drop rows already done; number the attempt of the rest (a Ray Data task)."""
    batch = batch.filter(pc.invert(pc.is_in(batch.column("id").cast(pa.string()), done)))
    numbers = [attempts.get(rid, 0) + 1 for rid in batch.column("id").to_pylist()]
    return batch.append_column("_attempt", pa.array(numbers, pa.int32()))


def build_dataset(
    files: InputFiles, out: OutputDir, done: list[str], attempts: dict[str, int], spec: EngineSpec
) -> Any:
    import ray
    import ray.data

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
    if done or attempts:
        ds = ds.map_batches(
            _select_todo,
            batch_format="pyarrow",
            batch_size=None,
            fn_kwargs={"done": pa.array(done, pa.string()), "attempts": attempts},
        )
    # With TP the ranks hold the GPUs (in the executor's placement group); without, the
    # engine runs in this actor and needs the GPU itself.
    has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    with warnings.catch_warnings():
        # NOTE: `max_restarts` has no named parameter yet; the `**ray_remote_args` it goes
        # through warns that it is deprecated (for Ray 2.64), though Ray Data's own comments
        # name `map_batches(..., max_restarts=0)` as the way to turn restarts off.
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        return ds.map_batches(
            EngineActor,
            fn_constructor_args=(spec.model,),
            fn_constructor_kwargs=spec.engine_kwargs,
            compute=ray.data.ActorPoolStrategy(size=spec.concurrency),
            batch_size=spec.batch_size,
            batch_format="pyarrow",
            num_cpus=spec.cpus_per_engine,
            num_gpus=1 if has_gpus and spec.tp == 1 else 0,
            # Not restarted: Ray Data hands every actor its arguments as object refs, and
            # Ray logs an error for each restartable actor built so (core_worker.cc,
            # "max_restarts > 0"). A restart would gain little: what an actor committed is on
            # disk, and a lost actor ends the job with the rest left for --resume.
            max_restarts=0,
        )


class EngineActor:
    """Ray Data's actor class for the pool: a `BatchEngine`, imported and built in the actor.
    The driver hands Ray Data this class only, so it never imports the engine (torch,
    xgrammar and transformers: seconds of a job's start)."""

    def __init__(self, model: str, **kwargs: Any):
        from serve_app.batch.engine import BatchEngine

        self.engine = BatchEngine(model, **kwargs)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return self.engine(batch)


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


@contextmanager
def ray_data_output(verbose: bool) -> Iterator[None]:
    """Ray Data's progress bars, per-run banners and INFO logs: shown only when `verbose`
    (the job draws its own progress). Restored afterwards (DataContext is per process)."""
    import ray.data
    from ray.util.debug import log_once

    context = ray.data.DataContext.get_current()
    saved = (context.enable_progress_bars, context.print_on_execution_start)
    data_logger = logging.getLogger("ray.data")
    level = data_logger.level
    if not verbose:
        context.enable_progress_bars = False
        context.print_on_execution_start = False
        data_logger.setLevel(logging.WARNING)
        # Ray Data warns once per process that its progress bars are off: they are on purpose.
        log_once("ray_data_progress_manager_disabled")
    try:
        yield
    finally:
        context.enable_progress_bars, context.print_on_execution_start = saved
        data_logger.setLevel(level)


class PipelineThread(threading.Thread):
    """Drains the dataset; `error` holds what ended it early, if anything."""

    def __init__(self, dataset: Any):
        super().__init__(name="batch-pipeline", daemon=True)
        self.dataset = dataset
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for _ in self.dataset.iter_internal_ref_bundles():
                pass
        except BaseException as exc:  # noqa: BLE001 (reported by the driver)
            self.error = exc
