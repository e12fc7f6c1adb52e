"""What start-up steps cost: each step as the service takes it now, beside the call it
replaced, side by side and alternated in one run.

- `tokenizer`: a fresh process loading the checkpoint's tokenizer, with
  `actors.tokenizer_file.load_tokenizer` and with `AutoTokenizer.from_pretrained` (which
  imports transformers' configuration modules, and torch with them). CPU seconds (the
  imports included), peak RSS, and whether torch was imported.
- `rope`: a fresh process that has imported torch, computing the tiny llama's Llama 3.1 RoPE
  frequencies with `actors.layers.rotary` and through transformers' config class.
- `batch_driver`: a fresh process taking what a batch job's driver needs, the model check and
  the actor class Ray Data gets (`EngineActor`), against importing the `BatchEngine` itself.
- `status_poll`: in a process that serves the tiny llama, one read of the application's
  status as `serve-app serve` polls it (`serve_app.placement.application_status`) against
  `serve.status()`, CPU ms per call.

    .venv/bin/python benchmarks/startup.py --out benchmarks/results/startup.json

Fresh-process figures are medians over `--runs` alternated runs of each side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import cpu_model, free_port, resolve_model, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# Each snippet prints one JSON line: CPU seconds since the interpreter started (after its own
# start-up, before the measured step: `base`), peak RSS and whether torch is loaded.
MEASURE = """
import json, sys, time
base = time.process_time()
{setup}
start = time.process_time()
{step}
done = time.process_time()
print(json.dumps({{
    "cpu_s": done - start,
    # This process's own peak (ru_maxrss would keep the forking parent's across exec).
    "rss_mb": [int(l.split()[1]) for l in open("/proc/self/status") if l[:6] == "VmHWM:"][0] / 1024,
    "torch": "torch" in sys.modules,
}}))
"""

STEPS = {
    "tokenizer": {
        "ours": ("", "from actors.tokenizer_file import load_tokenizer\nload_tokenizer({model!r})"),
        "replaced": (
            "",
            "from transformers import AutoTokenizer\nAutoTokenizer.from_pretrained({model!r})",
        ),
    },
    "rope": {
        "ours": (
            "import torch\nfrom actors.config import ModelConfig\n"
            "c = ModelConfig.from_pretrained({tiny!r}, dtype=torch.float32)",
            "from actors.layers.rotary import inv_freq_and_scale\n"
            "inv_freq_and_scale(c.path, c.head_dim, c.rope_parameters)",
        ),
        "replaced": (
            "import torch\nfrom actors.config import ModelConfig\n"
            "c = ModelConfig.from_pretrained({tiny!r}, dtype=torch.float32)",
            "from transformers import AutoConfig\n"
            "from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS\n"
            "hf = AutoConfig.from_pretrained(c.path)\n"
            "ROPE_INIT_FUNCTIONS['llama3'](hf, torch.device('cpu'))",
        ),
    },
    "batch_driver": {
        "ours": (
            "",
            "from serve_app.batch.job import _check_model\n"
            "from serve_app.batch.pipeline import EngineActor\n_check_model({tiny!r}, 1)",
        ),
        "replaced": (
            "",
            "from serve_app.batch.job import _check_model\n"
            "from serve_app.batch.engine import BatchEngine\n_check_model({tiny!r}, 1)",
        ),
    },
}


def fresh(setup: str, step: str, **names: str) -> dict:
    code = MEASURE.format(setup=setup.format(**names), step=step.format(**names))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def fresh_steps(runs: int, **names: str) -> dict:
    out = {}
    for step, sides in STEPS.items():
        seen: dict[str, list[dict]] = {side: [] for side in sides}
        for _ in range(runs):
            for side, (setup, code) in sides.items():
                seen[side].append(fresh(setup, code, **names))
        out[step] = {
            side: {
                "cpu_s": statistics.median(r["cpu_s"] for r in rows),
                "peak_rss_mb": statistics.median(r["rss_mb"] for r in rows),
                "imports_torch": rows[0]["torch"],
                "runs_cpu_s": [round(r["cpu_s"], 3) for r in rows],
            }
            for side, rows in seen.items()
        }
    return out


def status_poll(model: str, calls: int) -> dict:
    """CPU per status read in a process that serves `model`, the two reads alternated."""
    from ray import serve

    from serve_app.app import APP_NAME
    from serve_app.config.options import ServeConfig
    from serve_app.placement import application_status
    from serve_app.server import start, stop

    start(ServeConfig(model=model, port=free_port(), admin_port=free_port()))
    try:
        time.sleep(3)  # the replicas' first reports settle
        cost: dict[str, list[float]] = {"ours": [], "replaced": []}
        reads = {
            "ours": lambda: application_status(APP_NAME),
            "replaced": lambda: serve.status().applications[APP_NAME],
        }
        for _ in range(calls):
            for side, read in reads.items():
                began = time.process_time()
                read()
                cost[side].append((time.process_time() - began) * 1e3)
        return {side: {"cpu_ms_per_call": statistics.median(v)} for side, v in cost.items()}
    finally:
        stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the tokenizer's")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    model, tiny = resolve_model(args.model), resolve_model("tiny")
    result = {
        "cpu": cpu_model(),
        "checkpoint": {"tokenizer": model.label, "rope, batch_driver, status_poll": tiny.label},
        "dtype": "float32",
        "threads": "torch's default (not timed: imports and set-up only)",
        "runs": args.runs,
        **fresh_steps(args.runs, model=model.path, tiny=tiny.path),
        "status_poll": status_poll(tiny.path, args.calls),
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
