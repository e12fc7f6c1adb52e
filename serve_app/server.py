"""Start (or join) Ray, deploy the graph, wait for health, and shut down cleanly."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from serve_app import ray_env
from serve_app.backpressure import proxy_hold as proxy_flow
from serve_app.config.options import ServeConfig
from serve_app.ports import REASONS, Listener, bind_problem, check_free

logger = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130  # stopped by Ctrl-C (or SIGTERM) before the server was up
# How long a stop waits for Serve's controller to remove the apps, replicas and proxies.
SHUTDOWN_TIMEOUT_S = 30.0
PORT_RELEASE_TIMEOUT_S = 15.0
AUTH_MODE_ENV = "RAY_AUTH_MODE"


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

    from serve_app.placement import wait_deployed

    starts_ray = not ray.is_initialized() and not config.ray_address
    if starts_ray and config.direct_ingress:
        # The ingress replica binds `port` without SO_REUSEADDR: the connections of a server
        # stopped moments ago hold it for up to a minute (TCP TIME_WAIT), and the replica
        # would fail to start ("Failed to update the deployments ['ingress']"). Wait that out
        # as `serve-app serve` does; a port another program listens on is `PortInUse`.
        check_free([Listener(config.host, config.port, "port", False)], say=logger.warning)
    if starts_ray:
        # Before Ray starts: its proxy and replicas inherit this process's environment.
        ray_env.prepare(config.port if config.direct_ingress else None)
    # The app's modules (torch, xgrammar, transformers) and its identity (weight hashes, the
    # grammar backend's probe) cost the driver seconds of CPU; they need no Ray, so they are
    # done while Ray starts.
    with ThreadPoolExecutor(1, thread_name_prefix="build-app") as pool:
        identity = pool.submit(_app_identity, config)
        if not ray.is_initialized():
            if config.ray_address:
                ray.init(address=config.ray_address, log_to_driver=False)
            else:
                with ray_env.batch_scheduled_children():
                    _init_local_ray(ray_init_kwargs or {})
        identity = identity.result()
    from serve_app.app import APP_NAME, build_app, engine_placement

    _quiet_serve_driver_log()
    # NOTE: one proxy, on the head: the public address of a cluster is its head node. With
    # direct ingress the ingress replica binds `port` and Serve (2.60) still starts its proxy,
    # on the same host: there on a port the OS picks, serving the same app with the same hook.
    proxy_port = 0 if config.direct_ingress else config.port
    serve.start(proxy_location="HeadOnly", http_options={"host": config.host, "port": proxy_port})
    # The app brings its admin API with it (app.py); the proxy hook is the head's raylet's.
    if not (proxy_flow.is_enabled() if starts_ray else ray_env.head_has_proxy_hook()):
        logger.warning(proxy_flow.MISSING_HOOK_WARNING)
    # Not `serve.run`: it waits for RUNNING, for ever when a replica cannot be placed.
    target = serve.RunTarget(build_app(config, identity), name=APP_NAME, route_prefix="/")
    serve.run_many([target], wait_for_applications_running=False)
    wait_deployed(APP_NAME, config, engine_placement(config))
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    url = f"http://{host}:{config.port}"
    wait_healthy(url, timeout_s=120)
    return url


def _app_identity(config: ServeConfig) -> dict:
    from serve_app.app import app_identity

    return app_identity(config)


def choose_local_auth_mode() -> None:
    """Call before this process imports Ray, when it is to start a local one. Ray turns token
    authentication on by default for a local cluster and warns so on every start unless
    RAY_AUTH_MODE says it; saying "token" keeps that default (the token in ~/.ray/auth_token)
    without the warning. An operator's own value stays."""
    # NOTE: Ray reads the mode once, when it is imported; set later, the driver and the
    # cluster it starts disagree and the start fails.
    if "ray" not in sys.modules:
        os.environ.setdefault(AUTH_MODE_ENV, "token")


def _init_local_ray(kwargs: dict) -> None:
    import ray

    # The driver's "ray" logger at WARNING: "Started a local Ray instance." is not news.
    kwargs = {"include_dashboard": False, "logging_level": logging.WARNING, **kwargs}
    ray.init(address="local", log_to_driver=False, **kwargs)


def _quiet_serve_driver_log() -> None:
    """Serve's driver-side INFO lines off, its warnings and errors kept. `serve.run_many` calls
    Serve's start again itself, which logs "Connecting to existing Serve app ... New
    http_options will not be applied" every time; `serve.start` (the only public way to set
    http_options) has applied ours already, so the line is noise and wrong."""
    logging.getLogger("ray.serve").setLevel(logging.WARNING)


def stop() -> None:
    import ray

    if ray.is_initialized():
        _shutdown_serve(SHUTDOWN_TIMEOUT_S)
        ray.shutdown()


def _shutdown_serve(timeout_s: float) -> None:
    """`serve.shutdown()`, without the raylet's "Task ServeController.graceful_shutdown
    failed ... killed by `ray.kill`" line it prints on every stop."""
    import ray
    from ray import serve
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    def controller():
        try:
            return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except ValueError:
            return None

    handle = controller()
    if handle is None:
        return
    # NOTE: serve.shutdown() waits on graceful_shutdown(wait=True), a call that by design ends
    # only when the controller kills itself; that kill fails the call, which Serve marks as
    # retried for ever, and the raylet reports it. Ask without waiting, then watch the
    # controller go: it removes the apps, the replicas and the proxies first.
    deadline = time.monotonic() + timeout_s
    try:
        ray.get(handle.graceful_shutdown.remote(False), timeout=timeout_s)
    except ray.exceptions.RayActorError:
        return
    except ray.exceptions.GetTimeoutError:
        pass  # a stuck controller: reported below
    while controller() is not None:
        if time.monotonic() > deadline:
            logger.warning("Serve did not stop within %.0fs (see its controller's log)", timeout_s)
            return
        time.sleep(0.1)
    serve.shutdown()  # the controller is gone: this only forgets Serve's cached client


def run_forever(config: ServeConfig) -> None:
    """Start, print the banner, serve until SIGINT/SIGTERM, stop. A signal during the start
    stops what has started and raises KeyboardInterrupt; a second one during a stop exits at
    once (Ray's reaper ends the local cluster's processes)."""
    print(f"starting {config.model_id} from {config.model} ...", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # like Ctrl-C until it is up
    try:
        url = start(config)
    except BaseException:
        _forced_exit_on_next_signal()
        stop()
        raise
    print(banner(config, url), flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        done.wait()
    finally:
        print("stopping (Ctrl-C again to force)", flush=True)
        _forced_exit_on_next_signal()
        stop()
        _wait_ports_released(config, PORT_RELEASE_TIMEOUT_S)
        print("stopped", flush=True)


def _wait_ports_released(config: ServeConfig, timeout_s: float) -> None:
    """Return once nothing listens on the server's own ports, so "stopped" means a restart
    on the same ports works (after waiting out TIME_WAIT connections, see `serve_app.ports`).
    `ray.shutdown()` returns when it has signalled the local cluster's processes, not when
    they have exited: the replica that owns the socket under direct ingress (or the proxy)
    can hold the port a moment longer."""
    ports = [(config.host, config.port), (config.admin_host, config.admin_port)]
    deadline = time.monotonic() + timeout_s
    for host, port in ports:
        while port and bind_problem(host, port) == REASONS[errno.EADDRINUSE]:
            if time.monotonic() > deadline:
                logger.warning("port %d is still in use %.0fs after the stop", port, timeout_s)
                return
            time.sleep(0.1)


def banner(config: ServeConfig, url: str) -> str:
    admin = f"http://{config.admin_host}:{config.admin_port}/admin/v1/stats"
    rows = (
        ("model", f"{config.model_id} ({config.model})"),
        ("OpenAI API", f"{url}/v1"),
        ("admin API", admin),
        ("stop", "Ctrl-C (or SIGTERM)"),
    )
    return "ready\n" + "\n".join(f"  {name:<11}{value}" for name, value in rows)


def _forced_exit_on_next_signal() -> None:
    def force(*_: object) -> None:
        print("forced exit", file=sys.stderr, flush=True)
        os._exit(EXIT_INTERRUPTED)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, force)
