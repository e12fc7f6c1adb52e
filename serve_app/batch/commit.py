"""An engine actor's finished rows -> result files in the output directory, as they finish.

Rows wait at most `interval_s` after the first of them finished (`--commit-interval-s`), and
every engine call's last rows are committed when the call ends, so a killed job loses only
rows that had not finished, or had finished within the interval. Each file lands whole
(`batch_io.write_atomic`); its name sorts after every compacted file and is unique to the
run, the engine and the file's number.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from serve_app.batch.faults import FaultHook
from serve_app.batch.job_board import Counts, JobBoardClient, StopOrder
from serve_app.batch.parquet_io import OUTPUT_SCHEMA, PART_PREFIX, OutputDir, write_atomic

DEFAULT_COMMIT_INTERVAL_S = 10.0


@dataclass(frozen=True)
class CommitPlan:
    """What an engine actor needs to commit its rows (built by the driver)."""

    output_uri: str
    run_id: str  # sortable: a later run's files sort after an earlier one's
    interval_s: float = DEFAULT_COMMIT_INTERVAL_S


class RowCommitter:
    def __init__(self, plan: CommitPlan, faults: FaultHook):
        self.plan = plan
        self.out = OutputDir.open(plan.output_uri)
        self.engine_id = uuid.uuid4().hex[:8]
        self._faults = faults
        self._rows: list[dict[str, Any]] = []
        self._first_at: float | None = None  # time.monotonic() of the oldest waiting row
        self._num_files = 0

    def add(self, row: dict[str, Any]) -> None:
        if self._first_at is None:
            self._first_at = time.monotonic()
        self._rows.append(row)

    @property
    def is_due(self) -> bool:
        first = self._first_at
        return first is not None and time.monotonic() - first >= self.plan.interval_s

    def commit(self) -> Counts:
        """Write the waiting rows as one file; what it committed."""
        if not self._rows:
            return Counts()
        table = pa.Table.from_pylist(self._rows, schema=OUTPUT_SCHEMA)
        self._num_files += 1
        name = f"{PART_PREFIX}{self.plan.run_id}-{self.engine_id}-{self._num_files:06d}.parquet"
        before_rename = lambda: self._faults.reached("write")  # noqa: E731
        write_atomic(self.out.filesystem, f"{self.out.path}/{name}", table, before_rename)
        self._faults.reached("commit")
        committed = Counts(
            num_committed=len(self._rows),
            committed_prompt_tokens=sum(r.get("prompt_tokens") or 0 for r in self._rows),
            committed_completion_tokens=sum(r.get("completion_tokens") or 0 for r in self._rows),
            num_files=1,
        )
        self._rows, self._first_at = [], None
        return committed


class JobLink:
    """An engine actor's side of a job: its rows go to the committer, its counts to the board,
    and the board's stop order comes back."""

    def __init__(self, plan: CommitPlan, board: Any, faults: FaultHook):
        self.committer = RowCommitter(plan, faults)
        self.client = JobBoardClient(board, self.committer.engine_id)

    def begin_call(self) -> bool:
        """Whether to run this call: False once the job is stopping."""
        return self.client.post(is_busy=True, force=True) is None

    def finished(self, row: dict[str, Any]) -> None:
        self.committer.add(row)
        pending = self.client.pending
        pending.num_finished += 1
        pending.num_failed += row["status"] == "failed"
        pending.completion_tokens += row.get("completion_tokens") or 0

    def tick(self) -> StopOrder | None:
        """Between engine steps: commit what is due, post (at most every interval)."""
        if self.committer.is_due:
            self.client.pending.add(self.committer.commit())
        return self.client.post(is_busy=True)

    def drain_deadline(self) -> float | None:
        """time.monotonic() past which rows still running are left for --resume."""
        if self.client.stop is None or self.client.stop_seen_at is None:
            return None
        return self.client.stop_seen_at + self.client.stop.drain_timeout_s

    def end_call(self) -> None:
        self.client.pending.add(self.committer.commit())
        self.client.post(is_busy=False, force=True)
