#!/usr/bin/env bash
# The CUDA path on a machine with an NVIDIA GPU, in one short run: the platform's choices,
# a bf16 load, TP=1 greedy parity against transformers on the same GPU (fp32: token for token;
# bf16: reported), and a short offline benchmark (64 mixed requests, bf16). Prints JSON.
#
#   bash benchmarks/device_check.sh            # from the repository root, project installed
#   PY=/path/to/python bash benchmarks/device_check.sh
#
# Needs a torch build with CUDA in that interpreter (the CPU wheel this repository pins for its
# own machine has none) and the project's dependencies; it downloads nothing.
set -euo pipefail
PY=${PY:-.venv/bin/python}
exec "$PY" - "$@" <<'PYEOF'
import json
import sys
import tempfile
import time

sys.path.insert(0, "benchmarks")
import torch

from actors import LLM, SamplingParams, platform
from common import mixed_requests
from serve_app.checkpoints.factory import make_model

assert torch.cuda.is_available(), "no CUDA device: this check is for a GPU machine"
device = torch.device("cuda", 0)
out = {
    "device": platform.describe(),
    "default_dtype": str(platform.default_dtype()),
    "distributed_backend": platform.distributed_backend(),
    "prepacked_linear": platform.use_prepacked_linear(device),
    "kept_decode_gathers": platform.persistent_decode_gather(device),
}
root = tempfile.mkdtemp(prefix="device-check-")
tiny = str(make_model(f"{root}/tiny", "llama", "tiny", 0))
bench = str(make_model(f"{root}/bench", "llama", "bench", 0))

from transformers import AutoModelForCausalLM, GenerationConfig

prompts = [list(range(10 + i, 10 + i + 24 + 8 * i)) for i in range(4)]
for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=dtype).to(device).eval()
    config = GenerationConfig(max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=2)
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p], device=device), generation_config=config)[0, len(p):].tolist() for p in prompts]
    with LLM(model=tiny, dtype=name) as llm:
        got = [r.outputs[0].token_ids for r in llm.generate(prompts, SamplingParams(max_tokens=32, min_tokens=32, temperature=0))]
    same = sum(a == b for a, b in zip(got, want))
    out[f"tp1_parity_{name}"] = {"prompts": len(prompts), "identical": same}
    del hf
assert out["tp1_parity_float32"]["identical"] == len(prompts), out

requests = mixed_requests(64, 8192)
with LLM(model=bench, dtype="bfloat16") as llm:
    load = time.perf_counter()
    llm.generate([p for p, _ in requests[:4]], SamplingParams(max_tokens=8, temperature=0))
    params = [SamplingParams(max_tokens=m, min_tokens=m, temperature=0, ignore_eos=True) for _, m in requests]
    start = time.perf_counter()
    results = llm.generate([p for p, _ in requests], params)
    seconds = time.perf_counter() - start
tokens = sum(len(r.outputs[0].token_ids) for r in results)
out["bench_bf16_offline"] = {"requests": 64, "output_tokens": tokens, "tok_s": tokens / seconds}
print(json.dumps(out, indent=2))
PYEOF
