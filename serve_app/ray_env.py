"""The environment a local Ray must start with: Serve reads these settings once, when each of
its processes (controller, proxy, replicas) starts, and they inherit it from the raylet.

- The proxy's flow middleware (`serve_app.backpressure.proxy_hold`).
- Serve's gRPC data plane (`RAY_SERVE_USE_GRPC_BY_DEFAULT`): deployment handles and the
  proxy stream results to their callers over gRPC instead of one Ray object per item. A
  token stream is one item per token, so this is the serving path's largest per-token cost:
  `benchmarks/serve_hop.py` measures about 140 µs of CPU per item on the two sides of a
  hop instead of about 730, and at 16 streams the served tokens/s rise by about 30% (README).

- Serve's user code and router on each process's own event loop
  (`RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0`, `RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0`,
  part of Serve's own throughput profile): every streamed item otherwise crosses between two
  or three event loops in each process it passes. Measured with `benchmarks/serving.py` on
  the `bench` checkpoint: the serving path's CPU per token fell by about a fifth and 16
  streams made ~20% more tokens/s (docs/benchmarks.md). Sync methods still run in Serve's
  thread pool, so a blocking call never holds the loop.

- Serve's own metrics exported once a second (`RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=1000`;
  Serve's default is every 100 ms): every replica and every handle's router wakes that often
  to hand its cached counters to Ray's metrics agent, idle or not. Measured on an idle
  server, the serving path's processes (proxy, ingress, tokenizer, grammar, the engine
  replica's loop) used about a third less CPU (docs/benchmarks.md); Prometheus scrapes every
  10–15 s, so nothing a dashboard shows changes.

- Serve's controller reconciling twice a second (`RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5`;
  Serve's default is every 0.1 s): on an idle server its loop was the largest user of CPU
  (25 ms a second of the whole server's 100, against 11 at 0.5 s), and on a machine whose
  cores the engine's step threads fill, that CPU is taken from them: the engine driven
  directly beside an idle server made 5-10% fewer tokens a second than alone at 0.1 s and
  0-2% at 0.5 s (`benchmarks/idle_server.py`); served under load the difference stayed
  within the host's drift (docs/benchmarks.md). Deploys, scaling and replica recovery are
  noticed up to 0.4 s later, and stopping a local server took 6.0 s instead of 3.4.

- Serve's direct ingress, where `ServeConfig.direct_ingress` asks for it
  (`direct_ingress_settings`): the ingress replica serves HTTP on the server's port itself,
  so a token's SSE event is written by the process that framed it instead of crossing to
  Serve's proxy first (docs/operations.md). Serve's proxy hook (above) wraps that server too.

- The local Ray's processes under Linux's `SCHED_BATCH` (`batch_scheduled_children`;
  `SERVE_APP_BATCH_SCHEDULING=0` keeps the normal policy): Serve's proxy, the replicas and
  Ray's daemons inherit it from the thread that starts Ray, and a thread under it waits for a
  running thread's slice instead of preempting it when it wakes. The engine's step thread
  (and its OpenMP team) goes back to the normal policy (`actors/torch_thread.py`), so the
  serving path stops taking the step's core in the middle of its work. Measured on 2 cores
  (`bench`, 64 streams, one compute thread): the step thread ran 0.94 instead of 0.88-0.91 of
  the time, 881 and 851 against 790 and 827 tok/s, and the serving path used about 15% less
  CPU per token (docs/benchmarks.md).

An operator's own value of any setting is left in place. A cluster started by `ray
start` (or by Ray's `serve run CONFIG`) needs the same settings in that command's
environment: cluster.yaml has them, docs/deploy.md shows the commands.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from serve_app.backpressure import proxy_hold as proxy_flow

GRPC_ENV = "RAY_SERVE_USE_GRPC_BY_DEFAULT"
DIRECT_INGRESS_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
DIRECT_PORT_MIN_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"
DIRECT_PORT_MAX_ENV = "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"
METRICS_EXPORT_ENV = "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS"
CONTROL_LOOP_ENV = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
# What every node's `ray start` needs in its environment.
SETTINGS = {
    proxy_flow.CALLBACK_ENV: proxy_flow.CALLBACK_PATH,
    GRPC_ENV: "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    METRICS_EXPORT_ENV: "1000",
    CONTROL_LOOP_ENV: "0.5",
}
BATCH_SCHEDULING_ENV = "SERVE_APP_BATCH_SCHEDULING"
# A task on the head answers within this (a fresh worker starts in a few seconds).
PROBE_TIMEOUT_S = 60.0


def direct_ingress_settings(port: int) -> dict[str, str]:
    """Serve 2.60's direct ingress with the (one) ingress replica on `port`: Serve hands each
    ingress replica a port from [MIN, MAX) of its node, lowest first, and the replica binds it
    on `http_options.host`."""
    return {
        DIRECT_INGRESS_ENV: "1",
        DIRECT_PORT_MIN_ENV: str(port),
        DIRECT_PORT_MAX_ENV: str(port + 1),
        # Serve keeps a released port out of use for 150 s (for an HAProxy in front, which
        # this server has not): a restarted ingress replica would find no port to bind.
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        # A stopping ingress replica otherwise keeps serving 30 s more, for an external
        # balancer to notice; it still finishes the requests it holds.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }


def prepare(direct_ingress_port: int | None = None) -> None:
    """Call before this process starts a local Ray; with a port, Serve's direct ingress on it."""
    settings = dict(SETTINGS)
    if direct_ingress_port is not None:
        settings.update(direct_ingress_settings(direct_ingress_port))
    for name, value in settings.items():
        os.environ.setdefault(name, value)


def serves_direct_ingress(port: int) -> bool:
    """Whether Serve processes started from this environment give the ingress replica `port`
    (the ingress replica checks its own, which is its raylet's)."""
    return os.environ.get(DIRECT_INGRESS_ENV) == "1" and (
        os.environ.get(DIRECT_PORT_MIN_ENV) == str(port)
    )


def head_has_proxy_hook() -> bool:
    """Whether the cluster's proxy (on the head) runs our middleware. Asked of a task on the
    head node: a worker's environment is its raylet's, the proxy's too, whatever the
    environment of the process that deploys."""
    import ray

    from serve_app.ops.stats import HEAD_ONLY

    probe = ray.remote(num_cpus=0, resources=HEAD_ONLY)(proxy_flow.is_enabled)
    return bool(ray.get(probe.remote(), timeout=PROBE_TIMEOUT_S))


def refuse_missing_direct_ingress(direct_ingress: bool, port: int) -> None:
    """Raise (in the ingress replica: the deploy fails) where `direct_ingress` is asked of a
    Serve started without it: the app would answer only on Serve's proxy, elsewhere."""
    if direct_ingress and not serves_direct_ingress(port):
        raise RuntimeError(
            f"direct_ingress: this Ray's Serve was not started with {DIRECT_INGRESS_ENV}=1 and "
            f"{DIRECT_PORT_MIN_ENV}={port} (serve-app serve sets them when it starts Ray; a "
            "cluster needs them in its `ray start` environment, docs/deploy.md)"
        )


def grpc_data_plane() -> bool:
    """Whether Serve processes started from this environment stream over gRPC."""
    return os.environ.get(GRPC_ENV) == "1"


def data_plane_options() -> dict[str, object]:
    """Options for the engine handle: by reference unless this process's Serve streams over
    gRPC; over gRPC, replies (the engine's outputs, the channel's batches) in Serve's
    `pickle` instead of its default `cloudpickle`. cloudpickle calls a Python reducer for
    every object it meets: a step's channel batch of 64 outputs cost the engine replica 5.3
    µs an output to encode, 1.8 with `pickle` and the outputs' positional pickling
    (actors/outputs.py; `benchmarks/channel_wire.py`). Requests stay in cloudpickle: one
    carries its grammar's ObjectRef, which only Ray's cloudpickle reducer hands over with
    its ownership (under `pickle` a constrained request hung in the engine)."""
    if not grpc_data_plane():
        return {"_by_reference": True}
    return {"_by_reference": False, "response_serialization": "pickle"}


@contextmanager
def batch_scheduled_children() -> Iterator[None]:
    """Processes this thread starts inside run under `SCHED_BATCH` (Linux; unless
    `SERVE_APP_BATCH_SCHEDULING=0`); the thread's own policy is put back on the way out."""
    wanted = sys.platform.startswith("linux") and hasattr(os, "SCHED_BATCH")
    if not wanted or os.environ.get(BATCH_SCHEDULING_ENV, "1") == "0":
        yield
        return
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError:  # a policy this thread may not leave (a real-time one): keep it
        yield
        return
    try:
        yield
    finally:
        os.sched_setscheduler(0, policy, param)
