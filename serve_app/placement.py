"""Waiting for a deployed graph to come up, and failing (not hanging) when it cannot be placed.

Serve keeps a replica whose resources no node offers pending for ever. The server instead
gives each engine replica `engine.placement_timeout_s` to be placed; after that it tears the
application down and fails with a message naming the bundles, the largest node, what each
node has free and what holds the rest (actors/placement_failure.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from actors.placement_failure import fits_some_node, placement_failure_message
from serve_app.config.options import ServeConfig

logger = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "engine"
# Actor states of a replica Ray has not placed on a node yet.
_UNPLACED = ("DEPENDENCIES_UNREADY", "PENDING_CREATION")
# Deployment states whose message says why (DeploymentStatus values).
_FAILED = ("UNHEALTHY", "DEPLOY_FAILED")
# How long placed replicas may take to load their weights and start.
LOAD_TIMEOUT_S = 900.0


class DeploymentFailed(RuntimeError):
    """The graph could not start: unplaceable replicas, or replicas that fail to construct."""


def requested_bundles(options: dict[str, Any]) -> list[dict[str, float]]:
    """What one engine replica asks Ray for, as bundles (one when it has no placement group)."""
    if "placement_group_bundles" in options:
        return [dict(b) for b in options["placement_group_bundles"]]
    actor = options.get("ray_actor_options", {})
    bundle = {"CPU": float(actor.get("num_cpus", 1)), "GPU": float(actor.get("num_gpus", 0))}
    return [{k: v for k, v in bundle.items() if v}]


def unplaced_replicas(app_name: str, deployment: str = ENGINE_DEPLOYMENT) -> list[str]:
    """Names of the deployment's replica actors that Ray has not placed on any node."""
    # NOTE: the GCS actor table (a private module) answers without the dashboard, which
    # `serve-app serve` does not start; the public state API needs it.
    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    try:
        table = ray._private.state.actors()
    except Exception as exc:  # noqa: BLE001 (e.g. a ray:// client has no GCS view)
        logger.warning("cannot read the actor table (%s): waiting up to the load timeout", exc)
        return []
    return sorted(
        a["Name"]
        for a in table.values()
        if a.get("Name", "").startswith(prefix) and a.get("State") in _UNPLACED
    )


def pending_groups(app_name: str, deployment: str = ENGINE_DEPLOYMENT) -> list[str]:
    """Names of the deployment's replica placement groups Ray has not placed yet."""
    marker = f"{app_name}#{deployment}#"
    try:
        table = ray.util.placement_group_table()
    except Exception as exc:  # noqa: BLE001 (e.g. a ray:// client has no GCS view)
        logger.warning("cannot read placement groups (%s): waiting up to the load timeout", exc)
        return []
    return sorted(
        pg.get("name", "")
        for pg in table.values()
        if marker in pg.get("name", "") and pg.get("state") == "PENDING"
    )


def fits_the_cluster(bundles: list[dict[str, float]], strategy: str) -> bool:
    """Whether some alive node (all of the bundles on one node for STRICT_PACK) has the
    resources in total, busy or not: a request that fits waits for them; one that never
    can is what the placement timeout is for."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    return fits_some_node(bundles, strategy, nodes)


def application_status(app_name: str) -> tuple[Any, str]:
    """The application's status, and its message followed by each failed deployment's (a
    replica constructor's exception is only in its deployment's message).

    Read as the one application's status record (what `serve.run` itself waits on), not
    through `serve.status()`: that builds every deployment's full details and re-serializes
    each one's request router class. For this app that is 84 ms of CPU a call against 1.1
    (`benchmarks/startup.py`), polled while the replicas it waits for start on the same
    cores."""
    from ray import serve
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    read = getattr(client, "get_serve_status", None)
    if read is None:  # no controller yet, or a Serve without the call: the public API
        app = serve.status().applications.get(app_name)
        if app is None:
            return None, ""
        status, message = app.status, app.message
        deployments = [(name, d.status, d.message) for name, d in app.deployments.items()]
    else:
        overview = read(app_name)
        status, message = overview.app_status.status, overview.app_status.message
        deployments = [(d.name, d.status, d.message) for d in overview.deployment_statuses]
    failed = [f"{name}: {text}" for name, state, text in deployments if state in _FAILED]
    return status, "\n".join([message, *failed]) if failed else message


def wait_deployed(
    app_name: str,
    config: ServeConfig,
    engine_options: dict[str, Any],
    load_timeout_s: float = LOAD_TIMEOUT_S,
) -> None:
    """Return once the application is RUNNING; raise DeploymentFailed when Serve reports it
    failed, when an engine replica is still unplaced after `placement_timeout_s`, or when
    placed replicas have not started `load_timeout_s` after that."""
    from ray.serve.schema import ApplicationStatus

    timeout_s = config.engine.placement_timeout_s
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline + load_timeout_s:
        status, message = application_status(app_name)
        if status == ApplicationStatus.RUNNING:
            return
        if status == ApplicationStatus.DEPLOY_FAILED:
            raise DeploymentFailed(f"the deployment failed: {message}")
        if time.monotonic() > deadline:
            bundles = requested_bundles(engine_options)
            strategy = engine_options.get("placement_group_strategy", "one actor")
            # NOTE: a replica whose worker is still starting (a busy machine) is also
            # PENDING_CREATION: a replica with a placement group is unplaced while its group
            # is pending; one without, when no node could ever hold it.
            if "placement_group_bundles" in engine_options:
                unplaced = pending_groups(app_name)
            else:
                unplaced = unplaced_replicas(app_name)
                unplaced = [] if fits_the_cluster(bundles, strategy) else unplaced
            if unplaced:
                raise DeploymentFailed(
                    f"{len(unplaced)} engine replica(s) could not be placed: "
                    + placement_failure_message(bundles, strategy, timeout_s)
                )
        time.sleep(0.5)
    raise DeploymentFailed(f"the engine replicas were placed but not ready in {load_timeout_s:g}s")
