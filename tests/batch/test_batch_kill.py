"""`serve-app batch` killed at seeded points with real signals, then resumed: nothing that
was committed changes, nothing is lost, and the last run leaves exactly one row per input id.

One chain of subprocess jobs (the CLI as an operator runs it) over one input, each joining
the session's Ray and each told by SERVE_APP_BATCH_TEST_KILL_AT where to signal its driver:
before the first commit, mid-job at a commit and during a write, and during compaction, with
SIGKILL and a clean stop at each (all three signals at the first call). SIGINT and SIGTERM are
clean stops (exit 130 / 143, a summary, no traceback); a second signal quits at once. The output
bookkeeping (compaction's order of writes, readers of a cut-short compaction) is checked
without Ray at the end."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from serve_app.batch.faults import KILL_AT_ENV
from serve_app.batch.job import BatchSummary
from serve_app.batch.job_board import Counts
from serve_app.batch.parquet_io import OUTPUT_SCHEMA, OutputDir, compact, read_results, scan_results
from serve_app.batch.progress import ProgressView, format_duration, progress_line

NUM_ROWS = 160
LONG_ID = "row-000"  # runs far longer than a drain of 0 s: aborted by every clean stop
LONG_MAX_TOKENS = 900
STEP_DELAY_S = 0.002  # the long row takes at least 1.8 s
RUN_TIMEOUT_S = 180

# (kill points, expected exit status); the last run has only a compaction point, so it
# finishes the job. Each clean stop drains for 0 s, so rows still running are left.
CHAIN = [
    ("call:1:SIGKILL", -signal.SIGKILL),  # before the first commit
    ("call:1:SIGINT", 130),
    ("call:1:SIGTERM,compact:1:SIGINT", 143),  # the second signal lands in the compaction
    ("commit:2:SIGKILL", -signal.SIGKILL),  # mid-job
    ("commit:2:SIGINT,compact:1:SIGKILL", -signal.SIGKILL),  # stopping, then killed compacting
    ("write:2:SIGKILL", -signal.SIGKILL),  # a file written, not yet renamed
    ("write:3:SIGTERM", 143),
    ("compact:1:SIGTERM", 143),  # finishes every row; the stop lands in the compaction
]
PROGRESS_ANY = re.compile(r"^rows \d+/\d+ \(\d+ failed\) \d+ tok/s ETA (\?|\d+[hms]\S*)$")
PROGRESS = re.compile(rf"^rows \d+/{NUM_ROWS} \(\d+ failed\) \d+ tok/s ETA (\?|\d+[hms]\S*)$")


def _rows() -> pa.Table:
    ids = [f"row-{i:03d}" for i in range(NUM_ROWS)]
    max_tokens = [LONG_MAX_TOKENS if i == LONG_ID else 4 for i in ids]
    return pa.table({
        "id": ids,
        "prompt": [f"Item {i}: the" for i in range(NUM_ROWS)],
        "max_tokens": max_tokens,
        "ignore_eos": [i == LONG_ID for i in ids],
    })  # fmt: skip


def _files(out: Path) -> dict[str, list[dict]]:
    """Every result row on disk, by id (duplicates included), read file by file."""
    rows: dict[str, list[dict]] = {}
    for path in sorted(out.glob("[!._]*.parquet")):
        for row in pq.read_table(path).to_pylist():
            rows.setdefault(row["id"], []).append(row)
    return rows


def _final(row: dict) -> tuple:
    return row["status"], row["text"], tuple(row["token_ids"]), row["attempt"]


@pytest.fixture(scope="module")
def chain(ray_session, model_dirs, tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("batch-kill")
    inp = root / "in.parquet"
    pq.write_table(_rows(), inp)
    out = root / "out"
    address = ray_session.get_runtime_context().gcs_address
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.setdefault("RAY_AUTH_MODE", "token")  # the session's Ray's default: say it to join
    argv = [sys.executable, "-m", "serve_app.cli", "batch", str(inp), str(out), "--resume",
            "--model", str(model_dirs("llama")), "--address", address, "--temperature", "0",
            "--batch-size", "8", "--commit-interval-s", "0", "--drain-timeout-s", "0",
            "--progress-interval-s", "1",
            # A slow model, not a slow machine: the long row is still running at every stop.
            "--step-delay-s", str(STEP_DELAY_S)]  # fmt: skip
    runs = []
    for kill, expected in CHAIN:
        started = time.monotonic()
        job = subprocess.run(
            argv, env={**env, KILL_AT_ENV: kill}, capture_output=True, text=True,
            timeout=RUN_TIMEOUT_S,
        )  # fmt: skip
        temps = sorted(p.name for p in out.glob(".tmp-*"))
        runs.append({"kill": kill, "expected": expected, "rc": job.returncode,
                     "stdout": job.stdout, "stderr": job.stderr, "rows": _files(out),
                     "temps": temps, "wall_s": time.monotonic() - started})  # fmt: skip
    return runs


@pytest.mark.ray
def test_every_run_exits_as_its_signal_says(chain):
    for run in chain:
        assert run["rc"] == run["expected"], (run["kill"], run["wall_s"], run["stderr"][-3000:])


@pytest.mark.ray
def test_committed_rows_are_never_changed_and_the_last_run_has_one_row_per_id(chain):
    ids = {f"row-{i:03d}" for i in range(NUM_ROWS)}
    seen: dict[str, tuple] = {}
    for run in chain:
        rows = run["rows"]
        assert set(rows) <= ids
        for rid, copies in rows.items():
            # A cut-short compaction leaves identical copies, never two different rows.
            assert len({_final(r) for r in copies}) == 1, (run["kill"], rid)
            assert copies[0]["attempt"] == 1 and copies[0]["status"] in ("completed", "incomplete")
            if rid in seen:
                assert _final(copies[0]) == seen[rid], (run["kill"], rid)
            seen[rid] = _final(copies[0])
        # What is on disk only grows.
        assert set(seen) == set(rows), run["kill"]
    last = chain[-1]["rows"]
    assert set(last) == ids and all(len(c) == 1 for c in last.values())
    assert last[LONG_ID][0]["completion_tokens"] == LONG_MAX_TOKENS


@pytest.mark.ray
def test_work_is_committed_before_the_end_of_the_job(chain):
    by_kill = {run["kill"]: run for run in chain}
    assert not by_kill["call:1:SIGKILL"]["rows"]  # nothing had finished
    # Mid-job kills found rows of earlier calls on disk: the job commits as it goes.
    assert len(by_kill["commit:2:SIGKILL"]["rows"]) > len(
        by_kill["call:1:SIGTERM,compact:1:SIGINT"]["rows"]
    )
    for run in chain[:-1]:  # each left work for the next (so each reached its kill point)
        assert len(run["rows"]) < NUM_ROWS, run["kill"]


@pytest.mark.ray
def test_a_clean_stop_prints_a_summary_of_what_is_left_and_no_traceback(chain):
    for run in chain:
        assert "Traceback" not in run["stderr"], run["kill"]
        if run["expected"] not in (130, 143) or "compact:1:SIGINT" in run["kill"]:
            continue
        name = "SIGINT" if run["expected"] == 130 else "SIGTERM"
        assert f"batch: {name}: stopping" in run["stderr"]
        left = NUM_ROWS - len(run["rows"])
        assert f"left for --resume: {left} rows (stopped by {name})" in run["stdout"]
        assert re.search(r"this run: \d+ rows generated", run["stdout"])
    # The clean stop at the first call left the long row (drain 0 s), not its batch mates.
    stopped = next(r for r in chain if r["kill"] == "call:1:SIGINT")["rows"]
    assert LONG_ID not in stopped and len(stopped) >= 1


@pytest.mark.ray
def test_a_second_signal_quits_at_once(chain):
    run = next(r for r in chain if "compact:1:SIGINT" in r["kill"])
    assert "batch: SIGINT again: quitting now" in run["stderr"]
    assert "this run:" not in run["stdout"]  # no summary: it did not wait for anything


@pytest.mark.ray
def test_a_file_cut_short_by_sigkill_stays_a_temporary_until_the_next_run(chain):
    i = next(i for i, r in enumerate(chain) if r["kill"] == "write:2:SIGKILL")
    assert len(chain[i]["temps"]) == 1
    assert chain[i + 1]["temps"] == []


@pytest.mark.ray
def test_progress_is_one_line_per_interval_and_ray_data_is_quiet(chain):
    lines = [ln for run in chain for ln in run["stderr"].splitlines() if ln.startswith("rows ")]
    assert lines and all(PROGRESS.match(ln) for ln in lines), lines[:5]
    for run in chain:
        assert "ERROR" not in run["stderr"] and "WARNING" not in run["stderr"], run["kill"]
        assert "max_restarts" not in run["stderr"]
        assert "Total Progress" not in run["stderr"] and "Running Dataset" not in run["stderr"]


# ---------------------------------------------------------------------- no Ray


def _part(path: Path, rows: list[tuple[str, int, str]]) -> None:
    table = [{"id": i, "status": "completed", "attempt": a, "text": t} for i, a, t in rows]
    pq.write_table(pa.Table.from_pylist(table, schema=OUTPUT_SCHEMA), path)


def test_a_compaction_killed_after_its_write_loses_nothing(tmp_path):
    _part(tmp_path / "part-1.parquet", [("a", 1, "a1"), ("b", 1, "b1")])
    _part(tmp_path / "part-2.parquet", [("b", 2, "b2"), ("c", 1, "c1")])
    out = OutputDir.open(tmp_path)

    class Killed(Exception):
        pass

    def kill() -> None:
        raise Killed

    with pytest.raises(Killed):
        compact(out, on_written=kill)
    # The merged file landed before any part was removed: both states are on disk at once.
    names = sorted(p.name for p in tmp_path.glob("*.parquet"))
    assert names[0].startswith("compacted-") and names[1:] == ["part-1.parquet", "part-2.parquet"]
    texts = {r["id"]: r["text"] for r in read_results(out).to_pylist()}
    assert texts == {"a": "a1", "b": "b2", "c": "c1"}
    assert compact(out) == 4  # the superseded row and the copies of the cut-short merge
    assert len(list(tmp_path.glob("*.parquet"))) == 1
    assert {r["id"]: r["text"] for r in pq.read_table(tmp_path).to_pylist()} == texts
    assert set(scan_results(out)) == {"a", "b", "c"}


def test_compaction_keeps_large_clean_files_and_splits_merges_by_size(tmp_path):
    _part(tmp_path / "part-1.parquet", [(f"x{i}", 1, "x") for i in range(5)])
    _part(tmp_path / "part-2.parquet", [("y0", 1, "y"), ("y1", 1, "y")])
    _part(tmp_path / "part-3.parquet", [("z0", 1, "z"), ("z1", 1, "z")])
    out = OutputDir.open(tmp_path)
    assert compact(out, rows_per_file=3) == 0  # 2 + 2 would pass 3: nothing to merge
    assert len(list(tmp_path.glob("*.parquet"))) == 3
    assert compact(out, rows_per_file=4) == 0
    names = sorted(p.name for p in tmp_path.glob("*.parquet"))
    # The 5-row file stays as it is; the two small ones merge into one.
    assert names[0].startswith("compacted-") and names[1:] == ["part-1.parquet"]
    assert read_results(out).num_rows == 9


def test_progress_line_and_summary_read_as_the_operator_sees_them():
    assert progress_line(1200, 3000, 3, 41.2, 130) == "rows 1200/3000 (3 failed) 41 tok/s ETA 2m10s"
    assert progress_line(0, 10, 0, 0.0, None) == "rows 0/10 (0 failed) 0 tok/s ETA ?"
    assert [format_duration(s) for s in (0.2, 59, 61, 3725)] == ["1s", "59s", "1m01s", "1h02m"]
    summary = BatchSummary(
        output_dir="/out", num_rows=3000, num_completed=1190, num_incomplete=7,
        num_failed=3, num_retryable=1, num_missing=1800, num_kept=0, num_run=1200,
        prompt_tokens=9000, completion_tokens=12000, elapsed_s=60.0, stopped_by="SIGINT",
    )  # fmt: skip
    assert str(summary).splitlines() == [
        "batch: 3000 rows -> /out",
        "  completed 1190, incomplete 7, failed 3 (1 transient: --resume runs them again)",
        "  left for --resume: 1801 rows (stopped by SIGINT)",
        "  this run: 1200 rows generated, 0 kept from earlier runs, 12000 output tokens in "
        "60.0s (200.0 tokens/s)",
    ]
    assert summary.exit_status == 130


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere():
    counts = Counts(num_finished=1200, num_failed=3, completion_tokens=5000)
    terminal = _Terminal()
    view = ProgressView(3000, 0, stream=terminal)
    view.update(counts)
    view.close()
    last = terminal.getvalue().rstrip("\n").split("\r")[-1]
    assert last.startswith("rows 1200/3000 |") and "| (3 failed) " in last and "ETA " in last
    log = io.StringIO()
    view = ProgressView(3000, 100, stream=log, interval_s=0)
    view.update(counts)  # the first line waits one interval
    view.update(counts)
    assert PROGRESS_ANY.match(log.getvalue().strip()), log.getvalue()
    assert log.getvalue().startswith("rows 1300/3000 (3 failed) ")
