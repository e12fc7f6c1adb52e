"""What a person watching `serve-app batch` sees while it runs, on standard error.

On a terminal: one progress bar in rows (tqdm, as transformers and Ray Data already use),
redrawn as engines report. Otherwise (a log file, CI): one line every `interval_s`,

    rows 1200/3000 (3 failed) 41 tok/s ETA 2m10s

Rows count the whole job (those kept from earlier runs included); failed rows, tokens/s and
the ETA are this run's (its rate since the pipeline started, engine start-up included).
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

from serve_app.batch.job_board import Counts


def format_duration(seconds: float) -> str:
    """45s, 2m10s, 1h05m."""
    total = max(0, math.ceil(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def progress_line(
    num_done: int, num_total: int, num_failed: int, tokens_per_s: float, eta_s: float | None
) -> str:
    eta = format_duration(eta_s) if eta_s is not None else "?"
    return f"rows {num_done}/{num_total} ({num_failed} failed) {tokens_per_s:.0f} tok/s ETA {eta}"


class ProgressView:
    def __init__(
        self,
        num_total: int,
        num_kept: int,
        *,
        interval_s: float = 10.0,
        stream: TextIO | None = None,
    ):
        self.num_total = num_total
        self.num_kept = num_kept
        self.interval_s = interval_s
        self.stream = stream or sys.stderr
        self._started = time.monotonic()
        self._last_line: float | None = None
        self._bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=num_total,
                initial=num_kept,
                file=self.stream,
                # Our text in `desc`: tqdm prints `{desc}` as given (`{postfix}` gets a comma).
                bar_format="rows {n_fmt}/{total_fmt} |{bar}| {desc}",
                dynamic_ncols=True,
            )

    def line(self, counts: Counts) -> str:
        elapsed = time.monotonic() - self._started
        done = self.num_kept + counts.num_finished
        tokens_per_s = counts.completion_tokens / elapsed if elapsed > 0 else 0.0
        eta = None
        if counts.num_finished and elapsed > 0:
            eta = (self.num_total - done) / (counts.num_finished / elapsed)
        return progress_line(done, self.num_total, counts.num_failed, tokens_per_s, eta)

    def update(self, counts: Counts) -> None:
        text = self.line(counts)
        if self._bar is not None:
            self._bar.n = self.num_kept + counts.num_finished
            self._bar.set_description_str(_bar_postfix(text), refresh=True)
            return
        now = time.monotonic()
        if self._last_line is None:
            self._last_line = now  # the first line after one interval, not at once
        elif now - self._last_line >= self.interval_s:
            self._last_line = now
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _bar_postfix(line: str) -> str:
    """The line without its `rows n/total` head, which the bar shows itself."""
    return line.split(" ", 2)[2]
