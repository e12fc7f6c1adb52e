"""What the engine's outputs cost to put on Serve's gRPC wire and take off it: a decode step's
output-channel batch (`--streams` outputs of one token each, as `ChannelHub` sends it) and
one request (`EngineRequest` with a `--prompt-tokens` prompt), encoded and decoded by each of
Serve's two pickle-based serializers (`cloudpickle`, Serve's default, and `pickle`), with the
outputs pickled positionally (constructor and fields, `actors/outputs.py`) and by attribute
dict (a dataclass's default, the same fields in a twin class), side by side in one run. The
engine handle sends requests in cloudpickle (a request's grammar ObjectRef needs Ray's
reducer) and takes replies in `pickle` (`serve_app.ray_env.data_plane_options`).

    .venv/bin/python benchmarks/channel_wire.py --out benchmarks/results/channel_wire.json

Each figure is the best of `--repeats` timings of `--iterations` calls, in µs of this
process's CPU (one thread): the encode runs in the engine replica's event loop, the decode
in the ingress's. No Serve and no gRPC run here: `serve_hop.py` measures a whole hop.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import platform
import sys
import time
import types
import uuid

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from common import cpu_model, write_json  # noqa: E402

from actors.messages import EngineRequest  # noqa: E402
from actors.outputs import CompletionDelta, RequestOutput  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402

# Twins live in a module of their own: run as a script this file is `__main__`, whose
# classes cloudpickle pickles by value (their whole definition), unlike an importable one's.
TWINS = types.ModuleType("channel_wire_twins")
sys.modules[TWINS.__name__] = TWINS


def _by_dict_twin(cls: type) -> type:
    """`cls`'s fields in a plain dataclass, pickled by Python's default for one (a class
    reference and the instance's attribute dict), by reference as `cls` is."""
    spec = [
        (f.name, f.type, dataclasses.field(default=f.default, default_factory=f.default_factory))
        for f in dataclasses.fields(cls)
    ]
    twin = dataclasses.make_dataclass(f"{cls.__name__}ByDict", spec)
    twin.__module__ = TWINS.__name__
    setattr(TWINS, twin.__name__, twin)
    return twin


DeltaByDict = _by_dict_twin(CompletionDelta)
OutputByDict = _by_dict_twin(RequestOutput)


def step_batch(streams: int, positional: bool) -> list[tuple[str, object]]:
    """A decode step's channel item: (request id, output) for each stream, one token each,
    the prompt left off as `ChannelHub.push` leaves it."""
    delta_cls, out_cls = (
        (CompletionDelta, RequestOutput)
        if positional
        else (
            DeltaByDict,
            OutputByDict,
        )
    )
    batch = []
    for i in range(streams):
        request_id = uuid.uuid4().hex
        delta = delta_cls(0, [1000 + i], " token")
        batch.append((request_id, out_cls(f"{request_id}@0", [], [delta], 0, False)))
    return batch


def engine_request(prompt_tokens: int) -> EngineRequest:
    params = SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, seed=1)
    return EngineRequest(
        uuid.uuid4().hex,
        list(range(1000, 1000 + prompt_tokens)),
        params,
        flow_key=uuid.uuid4().hex,
        channel=uuid.uuid4().hex,
    )


def serializers() -> dict:
    from ray import cloudpickle

    # What Serve's RPCSerializer calls for each method (serve/_private/serialization.py).
    return {
        "cloudpickle": cloudpickle.dumps,
        "pickle": lambda obj: pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL),
    }


def best_us(fn, iterations: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(iterations):
            fn()
        best = min(best, (time.thread_time() - start) / iterations)
    return best * 1e6


def measure(obj, dumps, per: int, iterations: int, repeats: int) -> dict:
    data = dumps(obj)
    if pickle.loads(data) != obj:
        raise AssertionError("a round trip changed the object")
    return {
        "encode_us": round(best_us(lambda: dumps(obj), iterations, repeats) / per, 3),
        "decode_us": round(best_us(lambda: pickle.loads(data), iterations, repeats) / per, 3),
        "bytes": round(len(data) / per, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=160)
    parser.add_argument("--iterations", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    batches = {}
    for name, dumps in serializers().items():
        for positional in (True, False):
            batch = step_batch(args.streams, positional)
            key = f"{name}/{'positional' if positional else 'attribute_dict'}"
            batches[key] = measure(batch, dumps, args.streams, args.iterations, args.repeats)
    request = engine_request(args.prompt_tokens)
    requests = {
        name: measure(request, dumps, 1, args.iterations, args.repeats)
        for name, dumps in serializers().items()
    }
    served = batches["pickle/positional"]
    before = batches["cloudpickle/attribute_dict"]
    write_json(
        {
            "what": "µs of CPU per engine output (a step's channel batch) and per engine "
            "request, to encode and decode with Serve's serializers",
            "cpu": cpu_model(),
            "python": platform.python_version(),
            "checkpoint": None,
            "dtype": None,
            "threads": 1,
            "streams": args.streams,
            "prompt_tokens": args.prompt_tokens,
            "served": {
                "outputs": "pickle/positional",
                "requests": "cloudpickle",
                "why": "serve_app.ray_env.data_plane_options",
            },
            "per_output_in_a_step_batch": batches,
            "per_request": requests,
            "saved_us_per_output": round(
                before["encode_us"]
                + before["decode_us"]
                - served["encode_us"]
                - served["decode_us"],
                3,
            ),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
