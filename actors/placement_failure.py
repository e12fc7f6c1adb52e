"""Why a placement group could not be placed, in words an operator can act on.

A node's total resources say whether a request could ever fit; what is free now and what
holds the rest (other placement groups, actors outside any group) say why it does not fit
yet. Ray tells the last two through its GCS tables, which need no dashboard; when they
cannot be read (a `ray://` client, an older Ray) the message says so instead of guessing.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

import ray

logger = logging.getLogger(__name__)

# Placement groups the Ray executor creates for its ranks are named so that a failure
# message can tell "an LLM of this process that is still open" from anybody else's group.
EXECUTOR_GROUP_PREFIX = "tp-ranks"
# Enough for one screen; the rest is summarised as a count.
MAX_NODES_LISTED = 5
MAX_HOLDERS_LISTED = 8
_group_numbers = itertools.count()

Resources = dict[str, float]


def executor_group_name() -> str:
    """A fresh name for a placement group the executor of this process creates."""
    return f"{EXECUTOR_GROUP_PREFIX}-pid{os.getpid()}-{next(_group_numbers)}"


@dataclass(frozen=True)
class NodeView:
    node_id: str
    address: str
    total: Resources
    # None when Ray could not say what is free.
    available: Resources | None


@dataclass(frozen=True)
class Holder:
    """Something that keeps resources of one node: a placement group or an actor."""

    description: str
    node_id: str
    resources: Resources


def summed(bundles: Iterable[Resources]) -> Resources:
    total: Resources = {}
    for bundle in bundles:
        for key, value in bundle.items():
            total[key] = total.get(key, 0.0) + value
    return total


def fits_some_node(bundles: list[Resources], strategy: str, nodes: list[Resources]) -> bool:
    """Whether the nodes could hold the bundles when idle (all on one node for STRICT_PACK)."""

    def fits(need: Resources, node: Resources) -> bool:
        return all(node.get(k, 0.0) >= v for k, v in need.items())

    if strategy == "STRICT_PACK":
        return any(fits(summed(bundles), node) for node in nodes)
    return all(any(fits(b, node) for node in nodes) for b in bundles)


def _short(node_id: str) -> str:
    return node_id[:8]


def _only(resources: Resources, keys: Iterable[str]) -> Resources:
    return {k: round(resources.get(k, 0.0), 3) for k in keys}


def _alive_nodes() -> list[NodeView]:
    try:
        # NOTE: a private module, but it reads the GCS directly: the public state API
        # needs the dashboard, which neither `serve-app serve` nor the tests start.
        from ray._private import state

        available: dict[str, Resources] | None = state.available_resources_per_node()
    except Exception as exc:  # noqa: BLE001 (no GCS view, e.g. a ray:// client)
        logger.warning("cannot read the free resources per node: %s", exc)
        available = None
    return [
        NodeView(
            node_id=n["NodeID"],
            address=n.get("NodeManagerAddress", "?"),
            total=n.get("Resources", {}),
            available=None if available is None else available.get(n["NodeID"], {}),
        )
        for n in ray.nodes()
        if n.get("Alive")
    ]


def _group_holders() -> list[Holder]:
    """Placement groups that hold their reservation, one holder per group and node."""
    holders = []
    for group in ray.util.placement_group_table().values():
        if group.get("state") != "CREATED":
            continue
        per_node: dict[str, list[Resources]] = {}
        for index, bundle in group.get("bundles", {}).items():
            node_id = group.get("bundles_to_node_id", {}).get(index, "")
            per_node.setdefault(node_id, []).append(bundle)
        name = group.get("name") or group.get("placement_group_id", "?")[:12]
        for node_id, bundles in per_node.items():
            holders.append(Holder(f"placement group {name!r}", node_id, summed(bundles)))
    return holders


def _actor_holders() -> list[Holder]:
    """Alive actors that hold node resources themselves (not through a placement group)."""
    from ray._private import state
    from ray.core.generated import gcs_pb2

    # NOTE: the public actor table drops `required_resources`; the raw rows keep it.
    rows = state.state._connect_and_get_accessor().get_actor_table(None, "ALIVE")
    holders = []
    for row in rows:
        actor = gcs_pb2.ActorTableData.FromString(row)
        if actor.placement_group_id.strip(b"\0") or not actor.required_resources:
            continue
        resources = {k: v for k, v in actor.required_resources.items() if v}
        if not resources:
            continue
        label = actor.name or actor.class_name
        holders.append(Holder(f"actor {label} (pid {actor.pid})", actor.node_id.hex(), resources))
    return holders


def _holders() -> list[Holder] | None:
    try:
        return _group_holders() + _actor_holders()
    except Exception as exc:  # noqa: BLE001 (no GCS view, or a Ray whose tables differ)
        logger.warning("cannot tell what holds the cluster's resources: %s", exc)
        return None


def _describe_holder(holder: Holder, keys: list[str]) -> str:
    text = f"{holder.description} {_only(holder.resources, keys)} on node {_short(holder.node_id)}"
    own = f"placement group '{EXECUTOR_GROUP_PREFIX}-pid{os.getpid()}-"
    if holder.description.startswith(own):
        text += " (an LLM of this process that is still open: close() it or use `with LLM(...)`)"
    elif holder.description.startswith(f"placement group '{EXECUTOR_GROUP_PREFIX}-pid"):
        text += " (the tensor-parallel ranks of an engine in another process)"
    return text


def _free_now(nodes: list[NodeView], keys: list[str]) -> str:
    if any(n.available is None for n in nodes):
        return "Ray could not say what is free on each node"
    ranked = sorted(nodes, key=lambda n: [-(n.available or {}).get(k, 0.0) for k in keys])
    parts = [
        f"node {_short(n.node_id)} ({n.address}) has {_only(n.available or {}, keys)} free "
        f"of {_only(n.total, keys)}"
        for n in ranked[:MAX_NODES_LISTED]
    ]
    if len(ranked) > MAX_NODES_LISTED:
        parts.append(f"{len(ranked) - MAX_NODES_LISTED} more nodes")
    return "free now: " + ", ".join(parts)


def _held_by(holders: list[Holder] | None, keys: list[str]) -> str:
    if holders is None:
        return "Ray could not say what holds the rest"
    relevant = [h for h in holders if any(h.resources.get(k, 0.0) for k in keys)]
    if not relevant:
        return "no placement group or actor holds them (running tasks, or released since)"
    relevant.sort(key=lambda h: [-h.resources.get(k, 0.0) for k in keys])
    parts = [_describe_holder(h, keys) for h in relevant[:MAX_HOLDERS_LISTED]]
    if len(relevant) > MAX_HOLDERS_LISTED:
        parts.append(f"{len(relevant) - MAX_HOLDERS_LISTED} more")
    return "held by: " + ", ".join(parts)


def placement_failure_message(bundles: list[Resources], strategy: str, timeout_s: float) -> str:
    """Names the bundles, what they need together, the largest node's total, what each node
    has free now and, when the group could fit an idle cluster, what holds the rest."""
    nodes = _alive_nodes()
    need = {k: v for k, v in summed(bundles).items() if v}
    keys = list(need)
    largest = max(nodes, key=lambda n: (n.total.get("GPU", 0), n.total.get("CPU", 0)), default=None)
    have = _only(largest.total, keys) if largest is not None else {}
    where = " on one node" if strategy == "STRICT_PACK" else ""
    text = (
        f"placement group {bundles} ({strategy}) could not be placed within {timeout_s:g}s: "
        f"it needs {need}{where}; the largest of the {len(nodes)} nodes has {have} in total"
    )
    if not fits_some_node(bundles, strategy, [n.total for n in nodes]):
        return f"{text}, so it cannot fit this cluster; {_free_now(nodes, keys)}"
    return f"{text}; {_free_now(nodes, keys)}; {_held_by(_holders(), keys)}"
