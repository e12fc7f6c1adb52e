"""What the serving path costs the engine when it has a core of its own: `serving.py
--path-only --direct-ingress` with the engine on 2 threads (both of this machine's cores, the
figure of record) and on 1 (a core left to everything else), the two in alternation, each run
a fresh server in a child process.

On two cores the engine's OpenMP team fills both, so whatever else runs (the ingress, the
engine replica's event loop, the load generator, Ray's daemons) takes one of its threads off
its core, and the other waits for it at the next barrier. With one engine thread the same
serving path runs on the idle core. HTTP vs the engine driven directly is read against the
engine at the same thread count in both cases, so the ratio says how much the path costs
beside an engine that leaves it a core, as on a node with cores beyond the engine's.

    .venv/bin/python benchmarks/free_core.py --model bench \
        --out benchmarks/results/free_core_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from common import cpu_model, resolve_model, write_json  # noqa: E402

SERVING = os.path.join(os.path.dirname(__file__), "serving.py")
THREADS = (2, 1)
LEVELS = (16, 64)


def one_run(model: str, threads: int, runs: int) -> dict:
    """One `serving.py --path-only --direct-ingress` at `threads`, in a child: its figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "serving.json")
        command = [sys.executable, SERVING, "--model", model, "--path-only", "--direct-ingress"]
        command += ["--threads", str(threads), "--runs", str(runs), "--out", out]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            result = json.load(f)
    row: dict = {
        "serving_cpu_ms_per_token": result["serving_cpu_ms_per_token"],
        "serving_ttft_overhead_ms": result["serving_ttft_overhead_ms"],
    }
    for c in LEVELS:
        level = result[f"http_vs_direct_at_{c}"]
        row[f"at_{c}"] = {
            "ratio": level["ratio"],
            "http_tok_s": level["http_tok_s"],
            "direct_tok_s": level["direct_tok_s"],
            "run_ratios": [r["http"]["output_tok_s"] / r["direct_tok_s"] for r in level["runs"]],
            # Where the served engine's step threads spent each HTTP level.
            "step_threads": [r["http"]["engine_step_threads"] for r in level["runs"]],
        }
    return row


def summary(rows: list[dict]) -> dict:
    """Medians over rounds of each round's figures (each round's ratio a median of its runs)."""
    out: dict = {
        "serving_cpu_ms_per_token": statistics.median(r["serving_cpu_ms_per_token"] for r in rows),
        "serving_ttft_overhead_ms": statistics.median(r["serving_ttft_overhead_ms"] for r in rows),
    }
    for c in LEVELS:
        levels = [r[f"at_{c}"] for r in rows]
        shares = [s for lv in levels for s in lv["step_threads"] if s.get("threads")]
        out[f"at_{c}"] = {
            "ratio": statistics.median(lv["ratio"] for lv in levels),
            "http_tok_s": statistics.median(lv["http_tok_s"] for lv in levels),
            "direct_tok_s": statistics.median(lv["direct_tok_s"] for lv in levels),
            "step_threads_running": statistics.median(s["running"] for s in shares),
            "step_threads_waiting_for_cpu": statistics.median(s["waiting_for_cpu"] for s in shares),
            "step_threads_preempted_per_s": statistics.median(s["preempted_per_s"] for s in shares),
        }
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, c in enumerate(LEVELS):
        for j, threads in enumerate(THREADS):
            case = result["cases"][f"threads_{threads}"]
            x = i * 3 + j
            ax.bar(x, case["summary"][f"at_{c}"]["ratio"], color=f"C{j}", alpha=0.6)
            runs = [v for row in case["rounds"] for v in row[f"at_{c}"]["run_ratios"]]
            ax.scatter([x] * len(runs), runs, color="k", s=8)
    ax.axhline(result["target_ratio"], color="r", linestyle="--", linewidth=1)
    ax.set_xticks([0, 1, 3, 4])
    ax.set_xticklabels([f"{c} streams\n{t} thread{'s' * (t > 1)}" for c in LEVELS for t in THREADS])
    ax.set_ylabel("HTTP / engine driven directly")
    ax.set_title(f"{result['checkpoint']}, {result['cpu']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="bench")
    parser.add_argument("--rounds", type=int, default=3, help="alternations of 2 and 1 threads")
    parser.add_argument("--runs", type=int, default=3, help="serving.py's --runs in each")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rounds: dict[int, list[dict]] = {t: [] for t in THREADS}
    for r in range(args.rounds):
        for threads in THREADS if r % 2 == 0 else THREADS[::-1]:
            row = one_run(args.model, threads, args.runs)
            rounds[threads].append({"round": r, **row})
            ratios = [round(row[f"at_{c}"]["ratio"], 3) for c in LEVELS]
            print(f"round {r}, {threads} thread(s): HTTP vs direct {ratios}", file=sys.stderr)
    result = {
        "checkpoint": resolve_model(args.model).label,
        "dtype": "float32",
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": list(THREADS),
        "direct_ingress": True,
        "target_ratio": 0.9,
        "cases": {
            f"threads_{t}": {"replica_cpus": t, "summary": summary(rows), "rounds": rows}
            for t, rows in rounds.items()
        },
    }
    write_json(result, args.out)
    if args.out:
        plot(result, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
