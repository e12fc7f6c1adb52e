"""The benchmark scripts still run against today's code.

`make bench` runs every script in `benchmarks/`, hours at a time, and nothing else does: a
change to an interface a script uses broke it without a test noticing, until someone ran it.
`response_store_writes.py` built the Responses runner with arguments it no longer takes, and
`ingress_events.py`'s stand-in engine answered in a form the ingress no longer reads (every
request a 500). Here each script imports, and the ones that measure in-process run in their
quick form, with what they report checked.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.fresh_python import run_python

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def run_script(name: str, *args: str, timeout_s: float = 120) -> object:
    """The script run as `make bench` runs it; the JSON it prints."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_every_benchmark_script_imports():
    names = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
    code = (
        "import importlib, sys\n"
        "sys.path.insert(0, 'benchmarks')\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print(len(sys.modules))\n"
    )
    assert int(run_python(code)) > len(names)


def test_response_store_writes_batches_the_events_of_a_response():
    cases = run_script("response_store_writes.py", "--quick")
    assert [c["output_tokens"] for c in cases] == [100, 1000]
    for case in cases:
        # One event per token and a few around them; a record write carries many of them.
        assert case["events"] > case["output_tokens"]
        assert 2 <= case["store_writes"] <= case["events"] // 32
        assert case["bytes_written"] >= case["record_bytes"] + case["event_bytes"]


def test_channel_wire_measures_the_served_encoding():
    result = run_script("channel_wire.py", "--streams", "4", "--iterations", "10", "--repeats", "1")
    served = result["served"]["outputs"]
    per_output = result["per_output_in_a_step_batch"]
    assert served in per_output
    for row in (*per_output.values(), *result["per_request"].values()):
        assert row["bytes"] > 0 and row["encode_us"] > 0 and row["decode_us"] > 0


def test_event_stream_measures_each_response_class():
    result = run_script("event_stream.py", "--responses", "10", "--repeats", "1")
    assert result["responses"] == 10
    assert result["us_per_response"] and all(v > 0 for v in result["us_per_response"].values())


@pytest.mark.ray
def test_ingress_events_stand_in_streams_through_the_real_ingress(
    ray_session, model_dirs, monkeypatch, benchmark_modules
):
    from serve_app.backpressure import proxy_hold

    # ingress_app sets the proxy hook's variable, as on a node whose proxy runs the hold.
    monkeypatch.setenv(proxy_hold.CALLBACK_ENV, proxy_hold.CALLBACK_PATH)
    ingress_events = importlib.import_module("ingress_events")
    model = model_dirs("llama")
    max_tokens = 5

    async def stream() -> list[str]:
        engine = ingress_events.SteppedEngine(0.001)
        app = ingress_events.ingress_app(engine, model=str(model))
        stepper = asyncio.get_running_loop().create_task(engine.run())
        body = {"model": model.name, "prompt": [1, 2, 3, 4], "max_tokens": max_tokens}
        body |= {"stream": True, "temperature": 0}
        texts = []
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
                for _ in range(2):  # the second request's outputs come through the channel
                    r = await client.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    texts.append(r.text)
        finally:
            stepper.cancel()
        return texts

    for text in asyncio.run(stream()):
        data = [line for line in text.splitlines() if line.startswith("data: {")]
        # One event per token and the choice's finish; what the benchmark counts.
        assert len(data) == max_tokens + 1, text
        assert json.loads(data[-1][len("data: ") :])["choices"][0]["finish_reason"] == "length"
        assert text.rstrip().endswith("data: [DONE]")
