"""What an idle server costs the engine beside it: the engine driven directly (no HTTP) at 16
and 64 streams, alone, and beside a served app that takes no requests, with Serve's
controller reconciling every 0.1 s (Serve's default) and every 0.5 s (the served setting,
`serve_app/ray_env.py`). Each case runs in a fresh process, the cases in rotation, every run
recorded; beside each server its processes' idle CPU by role (ms a second, from `/proc`).

On two cores the engine's step threads fill both, so the served app's idle work (Serve's
controller loop, Ray's daemons, each replica's timers) is taken from them. `serving.py`'s
"direct" side runs beside its own idle server, so this tax is in both sides of its ratio.

    .venv/bin/python benchmarks/idle_server.py --model bench \
        --out benchmarks/results/idle_server_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import cpu_model, free_port, mixed_requests, resolve_model, write_json  # noqa: E402
from serving import IDLE_READING_S, direct_level  # noqa: E402

from serve_app.ray_env import CONTROL_LOOP_ENV  # noqa: E402

LEVELS = (16, 64)
CASES = {"alone": None, "idle_server_loop_0.1s": "0.1", "idle_server_loop_0.5s": "0.5"}
SETTLE_S = 10.0  # the replicas' start-up work (kernels, first health checks) done


def one_case(model: str, threads: int, max_tokens: int, run: int, serve: bool) -> dict:
    """This process: optionally a served app left idle, then the engine alone per level."""
    path = resolve_model(model).path
    row: dict = {}
    if serve:
        from cpu_accounting import idle_serve_cpu

        from serve_app.config.options import ServeConfig
        from serve_app.server import start

        config = ServeConfig(
            model=path,
            port=free_port(),
            admin_port=free_port(),
            direct_ingress=True,
            engine={"replica_cpus": threads, "max_model_len": 1024},
        )
        start(config, ray_init_kwargs={"num_cpus": 8})
        time.sleep(SETTLE_S)
        row["idle_ms_per_s"] = idle_serve_cpu(IDLE_READING_S)["by_role_ms_per_s"]
    try:
        for c in LEVELS:
            reqs = mixed_requests(2 * c, 2048, (64, 256), (max_tokens,) * 2, seed=100 * run + c)
            row[f"tok_s_at_{c}"] = direct_level(path, reqs, c, threads)
    finally:
        if serve:
            from serve_app.server import stop

            stop()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="bench")
    parser.add_argument("--threads", type=int, default=2, help="the engine's torch threads")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, in a child
    parser.add_argument("--run", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case is not None:
        row = one_case(args.model, args.threads, args.max_tokens, args.run, args.case != "alone")
        print(json.dumps(row))
        return
    runs: dict[str, list[dict]] = {name: [] for name in CASES}
    for r in range(args.runs):
        for name, interval in CASES.items():
            env = dict(os.environ)
            env.pop(CONTROL_LOOP_ENV, None)
            if interval is not None:
                env[CONTROL_LOOP_ENV] = interval
            command = [sys.executable, __file__, "--case", name, "--run", str(r)]
            command += ["--model", args.model, "--threads", str(args.threads)]
            command += ["--max-tokens", str(args.max_tokens)]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            runs[name].append({"run": r, **row})
            print(name, row, file=sys.stderr, flush=True)
    cases = {}
    for name, rows in runs.items():
        case: dict = {"control_loop_interval_s": CASES[name]}
        for c in LEVELS:
            case[f"tok_s_at_{c}"] = statistics.median(x[f"tok_s_at_{c}"] for x in rows)
        if "idle_ms_per_s" in rows[0]:
            roles = rows[0]["idle_ms_per_s"]
            case["idle_ms_per_s"] = {
                role: statistics.median(x["idle_ms_per_s"][role] for x in rows) for role in roles
            }
        cases[name] = {**case, "runs": rows}
    for case in cases.values():
        for c in LEVELS:
            case[f"vs_alone_at_{c}"] = case[f"tok_s_at_{c}"] / cases["alone"][f"tok_s_at_{c}"]
    result = {
        "checkpoint": resolve_model(args.model).label,
        "dtype": "float32",
        "threads": args.threads,
        "cpu": cpu_model(),
        "max_tokens": args.max_tokens,
        "cases": cases,
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
