"""What another process's CPU costs the engine on a machine whose cores its step threads
fill: the engine driven directly (no server, no Ray) at 16 streams, alone and beside
processes that use a fixed share of the machine in millisecond bursts, the way the serving
path's processes wake up per token. Interleaved runs, every run recorded; the JSON states
the checkpoint, dtype and threads, and the CPU share each load really got.

    .venv/bin/python benchmarks/contention.py --model bench \
        --out benchmarks/results/contention_bench.json

Each load is also run at niceness 19, which shows why the serving path cannot simply step
aside: the engine's threads leave no idle CPU, so a niced process gets little of what it
asks for.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import mixed_requests, resolve_model, write_json  # noqa: E402
from serving import direct_level  # noqa: E402

BURST_PERIOD_S = 0.002  # one wake-up every 2 ms, busy for `share` of it
CONCURRENCY = 16


def load(share: float, niceness: int, stop, got, index: int) -> None:
    """Busy for `share` of every period until `stop`; reports the CPU share it got."""
    if niceness:
        os.nice(niceness)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    while not stop.is_set():
        begin = time.perf_counter()
        while time.perf_counter() - begin < BURST_PERIOD_S * share:
            pass
        time.sleep(BURST_PERIOD_S * (1 - share))
    got[index] = (time.process_time() - cpu0) / (time.perf_counter() - wall0)


def run_beside(path: str, reqs, threads: int, cores: float, niceness: int) -> dict:
    """The engine's tok/s beside `threads` load processes using `cores` in all."""
    with mp.Manager() as manager:
        stop, got = mp.Event(), manager.dict()
        procs = [
            mp.Process(target=load, args=(cores / threads, niceness, stop, got, i))
            for i in range(threads if cores else 0)
        ]
        for proc in procs:
            proc.start()
        try:
            tok_s = direct_level(path, reqs, CONCURRENCY, threads)
        finally:
            stop.set()
            for proc in procs:
                proc.join()
        return {"tok_s": tok_s, "load_got_cores": sum(got.values())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="bench")
    parser.add_argument("--threads", type=int, default=2, help="the engine's torch threads")
    parser.add_argument("--loads", default="0.12,0.24", help="cores the other processes use")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = resolve_model(args.model)
    loads = [float(x) for x in args.loads.split(",")]
    cases = [("alone", 0.0, 0)] + [
        (f"{c:g}_cores{'_nice19' if n else ''}", c, n) for c in loads for n in (0, 19)
    ]
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in cases}
    for r in range(args.runs):
        reqs = mixed_requests(
            2 * CONCURRENCY, 2048, (64, 256), (args.max_tokens,) * 2, seed=100 * r + 16
        )
        for name, cores, niceness in cases:
            row = run_beside(model.path, reqs, args.threads, cores, niceness)
            runs[name].append({"run": r, **row})
            print(name, row, file=sys.stderr, flush=True)
    tok_s = {name: statistics.median(x["tok_s"] for x in rows) for name, rows in runs.items()}
    result = {
        "checkpoint": model.label,
        "dtype": "float32",
        "threads": args.threads,
        "concurrency": CONCURRENCY,
        "burst_period_ms": BURST_PERIOD_S * 1e3,
        "cases": {
            name: {
                "load_cores": cores,
                "niceness": niceness,
                "tok_s": tok_s[name],
                "vs_alone": tok_s[name] / tok_s["alone"],
                "load_got_cores": statistics.median(x["load_got_cores"] for x in runs[name]),
                "runs": runs[name],
            }
            for name, cores, niceness in cases
        },
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
