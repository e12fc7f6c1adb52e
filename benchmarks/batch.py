"""Batch benchmark: `serve-app batch` on Ray Data vs the offline `actors.LLM` on the same rows.

Both get the same Parquet rows (token-id prompts, per-row `max_tokens`, greedy, `ignore_eos` so
both do the same work) and the same number of torch threads. Reported: output tokens/s of the
batch job's pipeline (engine actors started, rows read, generated and written) and of the whole
command, against `LLM.generate` alone and with its model load. Target: the pipeline reaches
>= 0.8x of `LLM.generate`. Also measured: the pipeline's fixed start-up (the same command on
16 rows of 4-8 tokens: actor process, imports, model load, KV sizing, Parquet I/O), and the
pipeline's rate past it. Prints JSON; with --out also writes a PNG next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from common import DEFAULT_MODEL, mixed_requests, resolve_model, venv_tool, write_json  # noqa: E402

TARGET_RATIO = 0.8


def write_rows(path: Path, requests: list[tuple[list[int], int]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "id": [f"row-{i}" for i in range(len(requests))],
            "prompt_token_ids": [ids for ids, _ in requests],
            "max_tokens": [n for _, n in requests],
            "ignore_eos": [True] * len(requests),
        }
    )
    pq.write_table(table, path)


def run_batch_job(path: str, rows: Path, out: Path, threads: int, batch_size: int) -> dict:
    """`serve-app batch` as a user runs it; the pipeline time comes from its own summary."""
    argv = [venv_tool("serve-app"), "batch", str(rows), str(out), "--model", path]
    argv += ["--temperature", "0", "--concurrency", "1", "--cpus-per-engine", str(threads)]
    argv += ["--batch-size", str(batch_size)]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    start = time.perf_counter()
    job = subprocess.run(argv, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if job.returncode != 0:
        raise RuntimeError(f"serve-app batch failed:\n{job.stderr[-3000:]}")
    import pyarrow.parquet as pq

    table = pq.read_table(out).to_pydict()
    statuses = sorted(set(table["status"]))
    if statuses != ["incomplete"]:  # ignore_eos: every row runs to its max_tokens
        raise RuntimeError(f"unexpected row statuses {statuses}: {table['error_message'][:3]}")
    tokens = sum(table["completion_tokens"])
    pipeline_s = _pipeline_seconds(job.stdout)
    return {
        "rows": len(table["id"]),
        "output_tokens": tokens,
        "pipeline_s": pipeline_s,
        "command_s": wall,
        "pipeline_tok_s": tokens / pipeline_s,
        "command_tok_s": tokens / wall,
    }


def _pipeline_seconds(stdout: str) -> float:
    """The `... output tokens in 12.3s (...)` figure of the job's final summary."""
    import re

    match = re.search(r"output tokens in ([0-9.]+)s", stdout)
    if not match:
        raise RuntimeError(f"no summary in the batch job's output:\n{stdout[-2000:]}")
    return float(match.group(1))


def run_offline(path: str, requests: list[tuple[list[int], int]], threads: int) -> dict:
    import torch

    from actors import LLM, SamplingParams

    torch.set_num_threads(threads)
    start = time.perf_counter()
    llm = LLM(model=path)
    loaded = time.perf_counter()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in requests]
    outputs = llm.generate([ids for ids, _ in requests], params)
    done = time.perf_counter()
    llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "rows": len(outputs),
        "output_tokens": tokens,
        "generate_s": done - loaded,
        "load_and_generate_s": done - start,
        "generate_tok_s": tokens / (done - loaded),
        "load_and_generate_tok_s": tokens / (done - start),
    }


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch, offline = result["batch_job"], result["offline_llm"]
    labels = ["LLM.generate", "LLM load+generate", "batch pipeline", "batch command"]
    values = [
        offline["generate_tok_s"],
        offline["load_and_generate_tok_s"],
        batch["pipeline_tok_s"],
        batch["command_tok_s"],
    ]
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.barh(labels, values, color=["C0", "C0", "C1", "C1"])
    ax.axvline(TARGET_RATIO * offline["generate_tok_s"], color="gray", ls="--", label="0.8x target")
    ax.set_xlabel("output tokens/s")
    ax.set_title(f"{result['rows']} rows, {result['checkpoint']}, {result['threads']} threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="a trained preset, a seeded preset (bench, tiny) or a checkpoint folder / GGUF",
    )
    parser.add_argument("--quick", action="store_true", help="tiny checkpoint, 16 short rows")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    checkpoint = resolve_model("tiny" if args.quick else args.model)
    rows = 16 if args.quick else args.rows
    path = checkpoint.path
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    outputs = (8, 32) if args.quick else (16, 256)
    requests = mixed_requests(rows, vocab, (16, 256), outputs)
    with tempfile.TemporaryDirectory(prefix="batch-bench-") as tmp:
        rows_file = Path(tmp) / "rows.parquet"
        write_rows(rows_file, requests)
        batch = run_batch_job(path, rows_file, Path(tmp) / "out", args.threads, rows)
        probe_file = Path(tmp) / "probe.parquet"
        write_rows(probe_file, mixed_requests(16, vocab, (16, 32), (4, 8), seed=1))
        probe = run_batch_job(path, probe_file, Path(tmp) / "probe-out", args.threads, 16)
    offline = run_offline(path, requests, args.threads)
    if batch["output_tokens"] != offline["output_tokens"]:
        raise RuntimeError(
            f"different work: {batch['output_tokens']} vs {offline['output_tokens']}"
        )
    # The probe's whole pipeline is start-up plus ~100 tokens of work.
    past_startup = batch["output_tokens"] / (batch["pipeline_s"] - probe["pipeline_s"])
    result = {
        "checkpoint": checkpoint.label,
        "dtype": "float32",
        "rows": rows,
        "threads": args.threads,
        "batch_job": batch,
        "offline_llm": offline,
        "ratio": batch["pipeline_tok_s"] / offline["generate_tok_s"],
        "ratio_definition": "batch pipeline tokens/s / LLM.generate tokens/s",
        "command_ratio": batch["command_tok_s"] / offline["load_and_generate_tok_s"],
        "startup_s": probe["pipeline_s"],
        "pipeline_tok_s_past_startup": past_startup,
        "ratio_past_startup": past_startup / offline["generate_tok_s"],
        "target_ratio": TARGET_RATIO,
    }
    write_json(result, args.out)
    if args.out:
        plot(result, os.path.splitext(args.out)[0] + ".png")


if __name__ == "__main__":
    main()
