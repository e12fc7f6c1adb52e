"""Speculation on vs off, same requests, same process: tokens/s, acceptance, accepted length.

Workloads (trained model, greedy): `copy` — rewrite a given JSON object with one field changed,
quote spans back, edit a code snippet (the output repeats its prompt: prompt lookup pays);
`chat` — open questions (little to look up: speculation must not cost); and the JSON rewrite
under its record's JSON schema. Each at batch 1 (requests one at a time) and 16 (16 at once,
cycling the workload's prompts), after one warm-up pass, per proposer (`ngram`, `self_draft`):
tokens/s against speculation off, acceptance rate, mean tokens committed per verifying step;
each side runs `--repeats` times, interleaved; the speed-up is the median of the on / off ratios
of runs made next to each other, and the median run is reported beside.

    python benchmarks/speculative.py [--model smollm2-135m-instruct] [--k 4] [--draft-layers 22]
        [--batches 1,16] [--repeats 2] [--out FILE]
    python benchmarks/speculative.py --replot FILE.json   # the PNG beside a saved JSON
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import DEFAULT_MODEL, resolve_model, run_header, write_json  # noqa: E402

RECORD = {
    "name": "Ada Lovelace",
    "born": 1815,
    "city": "London",
    "fields": ["mathematics", "computing"],
    "notes": "first published algorithm",
}
CODE = (
    "def area(width, height):\n    result = width * height\n    return result\n\n"
    "print(area(3, 4))\n"
)
WORKLOADS = {
    "copy": [
        "Rewrite this JSON object with the city changed to Paris. Output only the JSON.\n"
        + json.dumps(RECORD),
        'Quote back every sentence of this text that mentions a river, word for word: "The Thames '
        "flows through London. Paris has many bridges. The Seine flows through Paris. Rome was "
        'built on seven hills."',
        "Rename the function `area` to `rectangle_area` in this code and output the whole code:\n"
        + CODE,
    ],
    "chat": [
        "Write a short poem about the sea.",
        "Why is the sky blue? Answer in three sentences.",
        "Give me three ideas for a weekend trip.",
    ],
}


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "born": {"type": "integer"},
        "city": {"type": "string"},
        "fields": {"type": "array", "items": {"type": "string"}},
        "notes": {"type": "string"},
    },
    "required": list(RECORD),
    "additionalProperties": False,
}


def batch_prompts(prompts: list[list[int]], batch: int) -> list[list[int]]:
    """`batch` requests cycling through the workload's prompts (at batch 1: each in turn)."""
    return [prompts[i % len(prompts)] for i in range(max(batch, len(prompts)))]


def run(
    model_path: str,
    prompts: list[list[int]],
    spec: dict | None,
    max_tokens: int,
    batch: int,
    grammar=None,
) -> dict:
    """The workload's requests `batch` at a time (each group runs to its end before the next
    starts), after one warm-up pass; greedy."""
    from actors import LLM, SamplingParams
    from actors.grammar_state import GrammarConstraint

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    requests = batch_prompts(prompts, batch)
    groups = [requests[i : i + batch] for i in range(0, len(requests), batch)]
    with LLM(model=model_path, speculative_config=spec) as llm:
        engine = llm.engine

        def generate(group: list[list[int]]) -> list[list[int]]:
            ids = []
            for prompt in group:
                request_id = f"bench-{engine.num_requests}"
                ids.append(request_id)
                constraints = None if grammar is None else [GrammarConstraint(grammar)]
                engine.add_request(request_id, prompt, params, constraints=constraints)
            out: dict[str, list[int]] = {r: [] for r in ids}
            while engine.has_unfinished():
                for o in engine.step():
                    for d in o.deltas:
                        out[o.request_id].extend(d.token_ids)
            return [out[r] for r in ids]

        for group in groups:
            generate(group)  # warm-up
        before = dict(engine.stats())
        seconds, outputs = 0.0, []
        for group in groups:
            started = time.perf_counter()
            outputs += generate(group)
            seconds += time.perf_counter() - started
        stats = engine.stats()
    tokens = sum(len(o) for o in outputs)
    proposed = stats["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    accepted = stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    drafts = stats["spec_drafts"] - before["spec_drafts"]
    return {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2),
        "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
        # Tokens each verifying step committed: its accepted draft tokens plus the target's own.
        "mean_accepted_length": round(1 + accepted / drafts, 2) if drafts else None,
        "proposed_tokens": proposed,
        "outputs": outputs,
    }


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the lower middle of an even count), without its
    outputs, and every run's tokens/s beside it."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
    middle = ranked[(len(ranked) - 1) // 2]
    return {
        **{k: v for k, v in middle.items() if k != "outputs"},
        "tokens_per_s_runs": [r["tokens_per_s"] for r in runs],
    }


def paired_speedup(off: list[dict], on: list[dict]) -> float:
    """The median over repeats of on / off tokens/s, each pair run next to each other (the
    machine's drift between repeats cancels within a pair)."""
    ratios = [b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(off, on, strict=True)]
    return round(statistics.median(ratios), 3)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["cases"]
    proposers = list(result["proposers"])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(proposers)
    for j, name in enumerate(proposers):
        xs = [i + (j - (len(proposers) - 1) / 2) * width for i in range(len(cases))]
        ys = [c["speedup"][name] for c in cases]
        ax.bar(xs, ys, width, label=name)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(cases)), [c["case"] for c in cases], rotation=15, fontsize=8)
    ax.set_ylabel("tokens/s, on / off")
    ax.set_title(f"speculative decoding, {result['checkpoint']} ({result['threads']} thread)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument(
        "--draft-layers", type=int, default=22, help="self_draft's num_draft_layers"
    )
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs of each side")
    parser.add_argument("--out")
    parser.add_argument("--replot", metavar="JSON", help="only draw the PNG of a saved run")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), args.replot.removesuffix(".json") + ".png")
        return
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.path)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    proposers = {
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k},
        "self_draft": {
            "method": "self_draft",
            "num_draft_layers": args.draft_layers,
            "num_speculative_tokens": args.k,
        },
    }
    result = {**run_header(model), "proposers": proposers, "cases": []}
    encoded = {
        name: [
            list(
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=True,
                )["input_ids"]
            )
            for text in texts
        ]
        for name, texts in WORKLOADS.items()
    }
    cases = [(name, int(b), None) for name in WORKLOADS for b in args.batches.split(",")]
    # Constrained copy-heavy: the JSON rewrite under the record's schema, batch 1.
    cases.append(("copy (JSON schema)", 1, grammar))
    for name, batch, g in cases:
        prompts = encoded["copy"][:1] if g is not None else encoded[name]
        # Interleaved repeats (off, then each proposer, again): the machine's speed drifts by
        # tens of percent between minutes, so one run of each side compares two moments.
        runs: dict[str, list[dict]] = {side: [] for side in ("off", *proposers)}
        for _ in range(args.repeats):
            runs["off"].append(run(model.path, prompts, None, args.max_tokens, batch, g))
            for proposer, spec in proposers.items():
                runs[proposer].append(run(model.path, prompts, spec, args.max_tokens, batch, g))
        off = median_run(runs["off"])
        case = {
            "case": f"{name}, batch {batch}",
            "workload": name,
            "batch": batch,
            "constrained": g is not None,
            "off": off,
            "speedup": {},
            "identical_outputs": {},
        }
        for proposer in proposers:
            on = median_run(runs[proposer])
            case[proposer] = on
            case["speedup"][proposer] = paired_speedup(runs["off"], runs[proposer])
            # Greedy verification commits what ordinary decode would: the outputs must agree.
            case["identical_outputs"][proposer] = all(
                r["outputs"] == runs["off"][0]["outputs"] for r in runs[proposer] + runs["off"]
            )
        result["cases"].append(case)
        print(json.dumps({k: case[k] for k in ("case", "speedup", "identical_outputs")}))
    write_json(result, args.out)
    if args.out:
        plot(result, args.out.removesuffix(".json") + ".png")


if __name__ == "__main__":
    main()
