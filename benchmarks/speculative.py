"""Speculation on vs off, same requests, same process: tokens/s, acceptance, accepted length.

Workloads (trained model, greedy): `copy` — rewrite a given JSON object with one field changed,
quote spans back, edit a code snippet (the output repeats its prompt: prompt lookup pays);
`chat` — open questions (little to look up: speculation must not cost). Each request runs
alone (batch 1) after one warm-up pass; the figures are per workload, summed over its prompts.

    python benchmarks/speculative.py [--model smollm2-135m-instruct] [--k 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.common import DEFAULT_MODEL, resolve_model, run_header, write_json

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out")
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
