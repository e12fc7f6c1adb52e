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

An operator's own value of any setting is left in place. A cluster started by `ray
start` (or by Ray's `serve run CONFIG`) needs the same settings in that command's
environment: cluster.yaml has them, docs/deploy.md shows the commands.
"""

from __future__ import annotations

import os

from serve_app.backpressure import proxy_hold as proxy_flow

GRPC_ENV = "RAY_SERVE_USE_GRPC_BY_DEFAULT"
# What every node's `ray start` needs in its environment.
SETTINGS = {
    proxy_flow.CALLBACK_ENV: proxy_flow.CALLBACK_PATH,
    GRPC_ENV: "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}
# A task on the head answers within this (a fresh worker starts in a few seconds).
PROBE_TIMEOUT_S = 60.0


def prepare() -> None:
    """Call before this process starts a local Ray."""
    for name, value in SETTINGS.items():
        os.environ.setdefault(name, value)


def head_has_proxy_hook() -> bool:
    """Whether the cluster's proxy (on the head) runs our middleware. Asked of a task on the
    head node: a worker's environment is its raylet's, the proxy's too, whatever the
    environment of the process that deploys."""
    import ray

    from serve_app.ops.stats import HEAD_ONLY

    probe = ray.remote(num_cpus=0, resources=HEAD_ONLY)(proxy_flow.is_enabled)
    return bool(ray.get(probe.remote(), timeout=PROBE_TIMEOUT_S))


def grpc_data_plane() -> bool:
    """Whether Serve processes started from this environment stream over gRPC."""
    return os.environ.get(GRPC_ENV) == "1"
