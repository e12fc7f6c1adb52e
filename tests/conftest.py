from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from serve_app import ray_env

# Whichever test starts this process's Ray (a fixture, or an engine with TP ranks), its
# workers inherit the environment a served Ray gets: flow middleware, gRPC data plane.
ray_env.prepare()

# Fixtures shared by the grammar, store and trained-model test modules.
pytest_plugins = ["grammar_fixtures", "postgres_fixtures", "trained_fixtures"]

# ---------------------------------------------------------------- factory checkpoints

ModelDirs = Callable[..., Path]


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> ModelDirs:
    """`model_dirs(arch, preset="tiny", seed=0)` -> a checkpoint built once per session."""
    # Imported here so collecting tests that need no model does not pay for torch.
    from serve_app.checkpoints.factory import make_model

    root = tmp_path_factory.mktemp("models")
    built: dict[tuple[str, str, int], Path] = {}

    def get(arch: str, preset: str = "tiny", seed: int = 0) -> Path:
        key = (arch, preset, seed)
        if key not in built:
            built[key] = make_model(root / f"{arch}-{preset}-{seed}", arch, preset, seed)
        return built[key]

    return get


# ------------------------------------------------------------------------ Ray session


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test run, always shut down at the end."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    # address="local": never join another Ray that happens to run on this machine.
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


# ---------------------------------------------------------------- served application


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serve_url(ray_session, model_dirs, tmp_path_factory):
    """The whole graph on the tiny llama, served on a free loopback port for the session."""
    from admin_client import wait_reporting
    from generation_fixtures import generation_options
    from ray import serve

    from serve_app.app import APP_NAME, build_app
    from serve_app.config.options import ServeConfig
    from serve_app.server import wait_healthy

    port = free_port()
    config = ServeConfig(
        model=str(model_dirs("llama")),
        port=port,
        admin_port=free_port(),
        generations=generation_options(tmp_path_factory.mktemp("data")),
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # The app brings its admin API (on config.admin_port) with it.
    serve.run(build_app(config), name=APP_NAME, route_prefix="/", blocking=False)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout_s=180)
        _SERVED["admin_url"] = f"http://127.0.0.1:{config.admin_port}"
        wait_reporting(_SERVED["admin_url"])
        yield url
    finally:
        serve.shutdown()


_SERVED: dict[str, str] = {}


@pytest.fixture(scope="session")
def admin_url(serve_url) -> str:
    """The admin API of the session's served application (its own loopback port)."""
    return _SERVED["admin_url"]


@pytest.fixture(scope="session")
def model_id(serve_url) -> str:
    """The id the session's server answers to (its checkpoint folder's name)."""
    import httpx

    return httpx.get(f"{serve_url}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="session")
def client(serve_url):
    """The official `openai` client on the session's server, without client-side retries."""
    import openai

    return openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0)
