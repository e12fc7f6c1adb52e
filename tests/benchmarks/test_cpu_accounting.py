"""The step threads' shares `serving.py` and `peer.py` print for each HTTP level."""

from __future__ import annotations

import importlib

import pytest


def test_step_thread_shares_average_over_the_threads_read_both_times(benchmark_modules):
    cpu_accounting = importlib.import_module("cpu_accounting")
    # (ns running, ns waiting for a CPU, times taken off the CPU while runnable)
    before = {"1/1": (0, 0, 100), "1/2": (0, 0, 0), "gone/3": (0, 0, 0)}
    after = {"1/1": (1_600_000_000, 200_000_000, 900), "1/2": (1_200_000_000, 600_000_000, 500)}
    shares = cpu_accounting.step_thread_shares(before, after, 2.0)
    assert shares["threads"] == 2
    assert shares["running"] == pytest.approx(0.7)
    assert shares["waiting_for_cpu"] == pytest.approx(0.2)
    assert shares["off_cpu"] == pytest.approx(0.1)
    assert shares["preempted_per_s"] == pytest.approx(325.0)  # (800 + 500) / 2 s / 2 threads
    assert cpu_accounting.step_thread_shares(before, {}, 2.0) == {"threads": 0}
