"""A second Serve app next to the session's one: same Ray, same HTTP proxy, its own name and
route prefix (one proxy port per Ray session), its own admin port (every app serves one)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

# Side apps share the session's machine: a small KV cache unless a test needs more.
SIDE_KV_CACHE_BYTES = 32 * 1024**2


def side_config(model_dir, model_name: str, data_dir, *, engine=None, **fields):
    """A side app's ServeConfig: its own model name, generations folder and admin port, and a
    small KV cache (`engine` adds to or overrides it)."""
    from serve_app.config.options import ServeConfig
    from serve_app.config.profiles import GenerationOptions
    from tests.support.ports import free_port

    generations = GenerationOptions(data_dir=str(data_dir), **fields.pop("generations", {}))
    fields.setdefault("admin_port", free_port())
    return ServeConfig(
        model=str(model_dir),
        served_model_name=model_name,
        engine={"kv_cache_bytes": SIDE_KV_CACHE_BYTES, **(engine or {})},
        generations=generations,
        **fields,
    )


def deploy(config, name: str, url: str, prefix: str) -> None:
    """Run `config`'s graph as app `name` under `prefix` and wait until `url` is healthy."""
    from ray import serve

    from serve_app.app import build_app
    from serve_app.server import wait_healthy

    serve.run(build_app(config), name=name, route_prefix=prefix, blocking=False)
    wait_healthy(url, timeout_s=180)


@contextmanager
def side_app(
    config, name: str, prefix: str, serve_url: str, ray_session, *, admin: bool = False
) -> Iterator[tuple[str, str | None]]:
    """The app's public URL and (with `admin`) its admin URL; deleted on the way out."""
    from ray import serve

    from tests.support.admin import wait_reporting

    url = f"{serve_url}{prefix}"
    admin_url = f"http://127.0.0.1:{config.admin_port}"
    try:
        deploy(config, name, url, prefix)
        wait_reporting(admin_url, config.engine.num_replicas)
        yield url, (admin_url if admin else None)
    finally:
        serve.delete(name)
