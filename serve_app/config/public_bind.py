"""A public address needs API keys, on every path that deploys the app.

`serve-app serve` checks its own `--host` (ServeConfig). Under `serve run CONFIG` or `serve
deploy`, the proxy's address comes from the Serve config's `http_options`, which ServeConfig
never sees: the ingress asks Serve's controller where its proxy listens and refuses to start
open on a non-loopback address.
"""

from __future__ import annotations

import logging

from serve_app.config.options import ServeConfig, is_loopback

logger = logging.getLogger(__name__)

CONTROLLER_TIMEOUT_S = 10.0


def proxy_host() -> str | None:
    """The address Serve's HTTP proxy binds, or None when no Serve controller answers."""
    try:
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        http = ray.get(controller.get_http_config.remote(), timeout=CONTROLLER_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 (no Serve here: nothing to check)
        logger.debug("proxy address unknown (%s)", type(exc).__name__)
        return None
    return getattr(http, "host", None)


def refuse_open_public_bind(config: ServeConfig, host: str | None) -> None:
    """Raise (the replica fails to start, so the deploy fails) for a public proxy address on
    a server without API keys."""
    if host is None or is_loopback(host) or config.api_keys is not None:
        return
    raise RuntimeError(
        f"http_options.host: refusing to serve on {host} (not loopback) without API keys; "
        "set api_keys_file in the application's args, or bind 127.0.0.1"
    )
