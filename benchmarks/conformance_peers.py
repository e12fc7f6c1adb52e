"""The conformance suite against the servers a user would pick instead: ours, vLLM's CPU build
and `transformers serve`, one after the other on the same checkpoint, each with its own record;
then `conformance diff` of each peer against ours, which lists every way the peer differs from
our contract (as regressions: a peer is compared with ours as a new revision would be).

Each server is served as its user would start it for this model, with what it offers turned
on: ours as `make serve` serves the trained model (the shipped template that renders tools),
with API keys (a limited and a restricted key too), an admin key and port, a text generation
profile and fault injection (`make conformance-diff`'s setup); vLLM with the same template,
its `hermes` tool parser and an API key; `transformers serve` with its own flags (it has no
key, template or tool-parser option). A case a server has no way to show is `unsupported`.

Writes, under --out DIR: `<side>.json` (the records), `<peer>-vs-ours.md/.json` (the diffs),
`table.md` (one row per case, one column per server) and `summary.json` (each server's counts
and identity, the diffs' regressions by kind), which it also prints.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
import vllm_peer  # noqa: E402
from common import DEFAULT_MODEL, free_port, resolve_model, venv_tool, write_json  # noqa: E402
from peer_servers import ServerProcess, start_theirs  # noqa: E402

from serve_app.conformance.cases import select  # noqa: E402
from serve_app.conformance.diff import diff_records  # noqa: E402
from serve_app.conformance.differences import Classification  # noqa: E402
from serve_app.conformance.record import Record  # noqa: E402
from serve_app.conformance.report import write_report  # noqa: E402
from serve_app.conformance.revisions import served_setup  # noqa: E402
from serve_app.conformance.runner import run_suite  # noqa: E402
from serve_app.conformance.session import Target  # noqa: E402

LABELS = {"ours": "ours", "vllm": "vLLM 0.32.0 (CPU)", "transformers": "transformers serve (CB)"}
START_TIMEOUT_S = 600.0
# The template `make serve` gives the trained model: SmolLM2's own renders no tools.
TOOLS_TEMPLATE = Path(__file__).parents[1] / "serve_app" / "checkpoints" / "smollm2_tools.jinja"


def start(side: str, path: str, template: str | None, log_dir: str):
    """The server and the suite's target (keys filled in; URLs once it is up)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    port = free_port()
    if side == "ours":
        flags, target = served_setup(Path(log_dir) / "ours", faults=True)
        admin_port = free_port()
        argv = [venv_tool("serve-app"), "serve", "--model", path, "--port", str(port)]
        argv += ["--admin-port", str(admin_port), *flags]
        argv += ["--chat-template", template] if template else []
        server = ServerProcess("ours", argv, port, log_dir, env)
        return server, replace(target, admin_url=f"http://127.0.0.1:{admin_port}")
    if side == "vllm":
        vllm_peer.ensure_venv()
        argv = vllm_peer.server_argv(path, port, "float32", served_name=Path(path).name)
        argv += ["--api-key", VLLM_KEY]
        if template:
            argv += ["--chat-template", template]
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
        server = ServerProcess("vllm", argv, port, log_dir, vllm_peer.environment(1, log_dir))
        return server, Target("", api_key=VLLM_KEY)
    return start_theirs(path, log_dir, env), Target("")


VLLM_KEY = "sk-conformance"
REGRESSION = Classification.REGRESSION


def run_side(side: str, path: str, template: str | None, log_dir: str, out: Path) -> Record:
    server, target = start(side, path, template, log_dir)
    started = time.monotonic()
    try:
        server.wait_healthy(START_TIMEOUT_S)
        print(f"==> {side} up in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
        target = replace(target, base_url=server.url, timeout_s=60.0)

        def progress(case) -> None:
            print(f"    {side} {case.id}: {case.verdict}", file=sys.stderr, flush=True)

        record = run_suite(target, select(), progress)
    finally:
        server.stop()
    record.save(out / f"{side}.json")
    return record


def table(records: dict[str, Record]) -> str:
    sides = list(records)
    lines = [
        "| case | " + " | ".join(LABELS[s] for s in sides) + " |",
        "|---|" + "---|" * len(sides),
    ]
    ids = [c["id"] for c in records["ours"].cases]
    for case_id in ids:
        cells = []
        for side in sides:
            case = records[side].case(case_id)
            cells.append(cell(case))
        lines.append(f"| `{case_id}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def cell(case: dict | None) -> str:
    if case is None:
        return "—"
    verdict = case["verdict"]
    if verdict == "pass":
        return "pass"
    if verdict == "unsupported":
        why = case.get("notes", {}).get("unsupported") or ""
        return f"unsupported: {short(why)}"
    return "**violation**: " + short("; ".join(case.get("violations") or []))


def short(text: str, limit: int = 110) -> str:
    text = text.replace("|", "/").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a checkpoint all three serve")
    parser.add_argument("--peers", default="vllm,transformers")
    parser.add_argument(
        "--chat-template",
        default=None,
        help="for ours and vLLM (default: the shipped tools template for the trained model)",
    )
    parser.add_argument(
        "--reuse", action="store_true", help="load a side's record from --out if it is there"
    )
    parser.add_argument("--out", required=True, help="a folder for the records and reports")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = resolve_model(args.model)
    template = args.chat_template
    if template is None and args.model == DEFAULT_MODEL:
        template = str(TOOLS_TEMPLATE)
    records: dict[str, Record] = {}
    summary: dict = {
        "checkpoint": checkpoint.label,
        "dtype": "float32",
        "threads": 1,
        "chat_template": template and Path(template).name,
    }
    for side in ["ours", *args.peers.split(",")]:
        if args.reuse and (out / f"{side}.json").is_file():
            records[side] = Record.load(out / f"{side}.json")
        else:
            with tempfile.TemporaryDirectory(prefix=f"conformance-{side}-") as log_dir:
                records[side] = run_side(side, checkpoint.path, template, log_dir, out)
        summary[side] = {
            "counts": records[side].counts(),
            "duration_s": records[side].duration_s,
            "identity": records[side].server.get("identity"),
            "observed": records[side].server.get("observed"),
        }
        if side != "ours":
            report = diff_records(records["ours"], records[side], [])
            write_report(report, out / f"{side}-vs-ours")
            summary[side]["differences_from_ours"] = report.summary_line()
            kinds = Counter(d.kind for d in report.differences if d.classification == REGRESSION)
            summary[side]["regressions_by_kind"] = dict(kinds.most_common())
    (out / "table.md").write_text(table(records))
    write_json(summary, str(out / "summary.json"))


if __name__ == "__main__":
    main()
