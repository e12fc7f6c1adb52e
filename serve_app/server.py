"""Start (or join) Ray, deploy the graph, wait for health, and shut down cleanly."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
import urllib.request

from serve_app import proxy_flow, ray_env
from serve_app.admin import start_admin
from serve_app.config import ServeConfig

logger = logging.getLogger(__name__)

# The admin server actor of the running deployment (started and stopped with it).
_ADMIN = None


def wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200 and json.loads(r.read()).get("status") == "ok":
                    return
        except Exception as exc:  # noqa: BLE001 (not up yet)
            last = str(exc)
        time.sleep(0.25)
    raise TimeoutError(f"{url}/health did not turn green within {timeout_s:.0f}s ({last})")


def start(config: ServeConfig, *, ray_init_kwargs: dict | None = None) -> str:
    """Deploy `config`; returns the base URL once /health answers. Ray is started locally
    unless `config.ray_address` names a cluster to join."""
    import ray
    from ray import serve

    from serve_app.app import APP_NAME, build_app, engine_placement
    from serve_app.placement import wait_deployed

    if not ray.is_initialized() and not config.ray_address:
        # Before Ray starts: its proxy and replicas inherit this process's environment.
        ray_env.prepare()
    if not proxy_flow.is_enabled():
        logger.warning(
            "%s is not %s here: a client that stops reading is held only when its "
            "engine window fills",
            proxy_flow.CALLBACK_ENV,
            proxy_flow.CALLBACK_PATH,
        )
    if not ray.is_initialized():
        if config.ray_address:
            ray.init(address=config.ray_address, log_to_driver=False)
        else:
            ray.init(
                address="local",
                include_dashboard=False,
                log_to_driver=False,
                **(ray_init_kwargs or {}),
            )
    global _ADMIN
    # NOTE: one proxy, on the head: the public address of a cluster is its head node.
    serve.start(proxy_location="HeadOnly", http_options={"host": config.host, "port": config.port})
    _ADMIN = start_admin(
        config.model_id,
        config.admin_host,
        config.admin_port,
        config.admin_api_key,
        config.api_keys,
    )
    # Not `serve.run`: it waits for RUNNING, for ever when a replica cannot be placed.
    target = serve.RunTarget(build_app(config), name=APP_NAME, route_prefix="/")
    serve.run_many([target], wait_for_applications_running=False)
    wait_deployed(APP_NAME, config, engine_placement(config))
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    url = f"http://{host}:{config.port}"
    wait_healthy(url, timeout_s=120)
    return url


def stop() -> None:
    import ray
    from ray import serve

    global _ADMIN
    if _ADMIN is not None:
        ray.kill(_ADMIN)
        _ADMIN = None
    serve.shutdown()
    if ray.is_initialized():
        ray.shutdown()


def run_forever(config: ServeConfig) -> None:
    try:
        url = start(config)
    except BaseException:
        stop()
        raise
    print(
        f"serving {config.model_id} at {url}/v1 (admin: http://{config.admin_host}:"
        f"{config.admin_port}/admin/v1/stats; Ctrl-C to stop)",
        flush=True,
    )
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        done.wait()
    finally:
        print("shutting down", flush=True)
        stop()
