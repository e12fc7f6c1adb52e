"""Owns a simulated multi-node Ray cluster for tests/cluster/test_cluster.py, in its own process.

Run as `python -m tests.support.cluster` from the repository root (a module, not a script, so
that Ray does not put tests/support/ on its workers' path). It starts a head with CPUs only and
two nodes with 2 fake GPUs each, prints `READY {json}` (the address and the nodes), then
answers one JSON command per stdin line with one `REPLY {json}` line:

- `{"cmd": "topology"}`: every live actor (class, name, node, pid, owner port) and node.
- `{"cmd": "logs_dir"}`: the cluster's Ray log folder.
- `{"cmd": "exit"}` (or end of stdin): shut the cluster down and exit.

Why a process of its own: `ray.init` happens once per process, and the test session already
holds a local Ray. Whatever happens, the cluster is shut down when this process ends (Ray's
reaper kills the node processes even if this one is killed).
"""

from __future__ import annotations

import json
import sys
from typing import Any

HEAD_CPUS = 2
GPU_NODE_CPUS = 3  # bundle 0 (the replica) + one CPU per rank of a TP=2 replica
GPU_NODE_GPUS = 2
NUM_GPU_NODES = 2


def nodes() -> list[dict[str, Any]]:
    import ray

    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        resources = n.get("Resources", {})
        out.append(
            {
                "node_id": n["NodeID"],
                "is_head": "node:__internal_head__" in resources,
                "cpus": resources.get("CPU", 0),
                "gpus": resources.get("GPU", 0),
            }
        )
    return out


def placement_groups() -> list[dict[str, Any]]:
    import ray

    return [
        {
            "name": pg["name"],
            "state": pg["state"],
            "strategy": pg["strategy"],
            "bundles": list(pg["bundles"].values()),
            "bundles_to_node_id": pg["bundles_to_node_id"],
        }
        for pg in ray.util.placement_group_table().values()
    ]


def actors(all_states: bool = False) -> list[dict[str, Any]]:
    import ray

    table = ray._private.state.actors()
    return [
        {
            "state": a.get("State"),
            "class_name": a["ActorClassName"],
            "name": a.get("Name", ""),
            "node_id": a["Address"]["NodeID"],
            "port": a["Address"]["Port"],
            "owner_port": a["OwnerAddress"]["Port"],
            "pid": a.get("Pid"),
        }
        for a in table.values()
        if all_states or a.get("State") == "ALIVE"
    ]


def answer(command: dict[str, Any]) -> dict[str, Any]:
    import ray

    if command["cmd"] == "topology":
        return {
            "nodes": nodes(),
            "actors": actors(command.get("all_states", False)),
            "placement_groups": placement_groups(),
        }
    if command["cmd"] == "logs_dir":
        return {"logs_dir": ray._private.worker._global_node.get_logs_dir_path()}
    return {"error": f"unknown command {command['cmd']!r}"}


def reply(tag: str, payload: dict[str, Any]) -> None:
    sys.stdout.write(f"{tag} {json.dumps(payload)}\n")
    sys.stdout.flush()


def main() -> int:
    import ray
    from ray.cluster_utils import Cluster

    from serve_app import ray_env

    ray_env.prepare()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": HEAD_CPUS, "num_gpus": 0, "include_dashboard": False},
    )
    try:
        for _ in range(NUM_GPU_NODES):
            cluster.add_node(num_cpus=GPU_NODE_CPUS, num_gpus=GPU_NODE_GPUS)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        reply("READY", {"address": cluster.address, "nodes": nodes()})
        for line in sys.stdin:
            if not line.strip():
                continue
            command = json.loads(line)
            if command["cmd"] == "exit":
                break
            reply("REPLY", answer(command))
    finally:
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
