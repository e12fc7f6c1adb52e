"""Speculation on vs off, same requests, same process: tokens/s, acceptance, accepted length.

Workloads (trained model, greedy): `copy` — rewrite a given JSON object with one field changed,
quote spans back, edit a code snippet (the output repeats its prompt: prompt lookup pays);
`chat` — open questions (little to look up: speculation must not cost). Each request runs
alone (batch 1) after one warm-up pass; the figures are per workload, summed over its prompts.

    python benchmarks/speculative.py [--model smollm2-135m-instruct] [--k 4] [--out FILE]
    python benchmarks/speculative.py --replot FILE.json   # the PNG beside a saved JSON
"""

from __future__ import annotations

import argparse
import json
import os
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


def run(model_path: str, prompts: list[list[int]], spec: dict | None, max_tokens: int) -> dict:
    from actors import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    with LLM(model=model_path, speculative_config=spec) as llm:
        for prompt in prompts:
            llm.generate([prompt], params)  # warm-up
        before = dict(llm.engine.stats())
        seconds, tokens, outputs = 0.0, 0, []
        for prompt in prompts:
            started = time.perf_counter()
            result = llm.generate([prompt], params)[0]
            seconds += time.perf_counter() - started
            tokens += len(result.outputs[0].token_ids)
            outputs.append(result.outputs[0].token_ids)
        stats = llm.engine.stats()
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
        "outputs": outputs,
    }


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    off = [result["workloads"][n]["off"]["tokens_per_s"] for n in names]
    on = [result["workloads"][n]["ngram"]["tokens_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], off, 0.4, label="speculation off")
    ax.bar([x + 0.2 for x in xs], on, 0.4, label="ngram")
    for x, n in zip(xs, names, strict=True):
        ax.annotate(f"{result['workloads'][n]['speedup']:.2f}x", (x + 0.2, on[x]), ha="center")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("output tokens/s (batch 1, greedy)")
    ax.set_title(f"speculative decoding, {result['checkpoint']} ({result['threads']} thread)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out")
    parser.add_argument("--replot", metavar="JSON", help="only draw the PNG of a saved run")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), args.replot.removesuffix(".json") + ".png")
        return
    torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.path)
    spec = {"method": "ngram", "num_speculative_tokens": args.k}
    result = {**run_header(model), "batch": 1, "speculative_config": spec, "workloads": {}}
    for name, texts in WORKLOADS.items():
        prompts = [
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
        off = run(model.path, prompts, None, args.max_tokens)
        on = run(model.path, prompts, spec, args.max_tokens)
        result["workloads"][name] = {
            "off": {k: v for k, v in off.items() if k != "outputs"},
            "ngram": {k: v for k, v in on.items() if k != "outputs"},
            "speedup": round(on["tokens_per_s"] / off["tokens_per_s"], 3),
            # Greedy verification commits what ordinary decode would: the outputs must agree.
            "identical_outputs": on["outputs"] == off["outputs"],
        }
    write_json(result, args.out)
    if args.out:
        plot(result, args.out.removesuffix(".json") + ".png")


if __name__ == "__main__":
    main()
