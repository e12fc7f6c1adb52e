"""The Serve config file route (`serve run` / `serve deploy`) builds the same graph."""

from __future__ import annotations

import logging
import os
import socket
import threading
from pathlib import Path

import pytest
import yaml
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import ServeDeploySchema

from serve_app.app import app_builder

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "serve_config.yaml"


def test_serve_config_file_validates_and_builds_the_graph(model_dirs):
    data = yaml.safe_load(CONFIG.read_text())
    schema = ServeDeploySchema.model_validate(data)
    (app,) = schema.applications
    assert app.import_path == "serve_app.app:app_builder"
    args = {**app.args, "model": str(model_dirs("llama"))}
    built = call_user_app_builder_with_args_if_necessary(app_builder, args)
    # The ingress is the graph's root; it binds the three worker deployments.
    assert built._bound_deployment.name == "ingress"


def test_no_replica_imports_the_graph_module_and_each_stops_on_the_short_wait_loop(model_dirs):
    """A replica imports the module its class is defined in: one defined in serve_app.app would
    load every deployment's imports (the responses replica once came up 7 s later for it). And
    an idle stage of a stop waits one wait loop, so each deployment uses the short one."""
    from ray.serve import Application

    from serve_app.app import SHUTDOWN_WAIT_LOOP_S, build_app
    from serve_app.config.options import ServeConfig

    seen = {}

    def walk(app: Application) -> None:
        deployment = app._bound_deployment
        seen[deployment.name] = deployment
        bound = [*deployment.init_args, *deployment.init_kwargs.values()]
        for child in bound:
            if isinstance(child, Application) and child._bound_deployment.name not in seen:
                walk(child)

    walk(build_app(ServeConfig(model=str(model_dirs("llama")))))
    assert set(seen) == {"ingress", "tokenizer", "grammar", "engine", "admin", "responses"}
    for name, deployment in seen.items():
        assert deployment.func_or_class.__module__ != "serve_app.app", name
        assert deployment._deployment_config.graceful_shutdown_wait_loop_s == SHUTDOWN_WAIT_LOOP_S


def test_serve_config_with_a_bad_field_fails_naming_it(model_dirs):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_num_seqs"):
        app_builder({"model": str(model_dirs("llama")), "engine": {"max_num_seqs": 0}})


def test_strict_structured_output_refuses_to_start_when_xgrammar_cannot(model_dirs, monkeypatch):
    import xgrammar as xgr

    from serve_app.app import probe_grammar_backend
    from serve_app.config.options import ServeConfig

    def refuse(*args, **kwargs):
        raise RuntimeError("unsupported tokenizer")

    monkeypatch.setattr(xgr.TokenizerInfo, "from_huggingface", refuse)
    model = str(model_dirs("llama"))
    lenient = probe_grammar_backend(ServeConfig(model=model))
    assert (
        lenient["available"] is False and "unsupported tokenizer" in lenient["unavailable_reason"]
    )
    strict = ServeConfig(model=model, grammar={"strict_structured_output": True})
    with pytest.raises(RuntimeError, match="strict_structured_output"):
        probe_grammar_backend(strict)


def test_store_urls_other_than_sqlite_and_postgresql_are_refused(model_dirs):
    from pydantic import ValidationError

    from serve_app.config.options import ServeConfig

    model = str(model_dirs("llama"))
    with pytest.raises(ValidationError, match="store: 'mysql://db/x'"):
        ServeConfig(model=model, store="mysql://db/x")
    for url in ("sqlite:///x.db", "postgresql://user@db:5432/x"):
        assert ServeConfig(model=model, store=url).store == url


# ------------------------------------------------- the import-path form and the admin port


@pytest.mark.parametrize("field", ["host", "port"])
def test_app_args_refuse_the_http_address_that_serve_owns(model_dirs, field):
    with pytest.raises(ValueError, match=f"{field}: .*http_options.{field}"):
        app_builder({"model": str(model_dirs("llama")), field: 8123})


@pytest.mark.parametrize("ray_running", [False, True])
def test_the_builder_sets_the_proxy_hook_only_for_a_ray_it_is_about_to_start(
    model_dirs, monkeypatch, ray_running
):
    """`serve run IMPORT_PATH` builds the app, then starts Ray: that Ray gets our settings.
    In a running Ray (a config file's build task) the environment is the cluster's."""
    from actors.executor import ray_tp
    from serve_app import app, ray_env

    for name in ray_env.SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(app.ray, "is_initialized", lambda: ray_running)
    # No Ray to ask here (engine_uses_gpu asks ray_tp.cluster_has_gpus).
    monkeypatch.setattr(ray_tp, "cluster_has_gpus", lambda: False)
    app_builder({"model": str(model_dirs("llama"))})
    for name, value in ray_env.SETTINGS.items():
        assert os.environ.get(name) == (None if ray_running else value)


@pytest.mark.parametrize("hooked", [True, False])
def test_the_ingress_warns_once_where_the_proxy_runs_without_the_hook(
    model_dirs, monkeypatch, caplog, tmp_path, hooked
):
    from serve_app.app import served_identity
    from serve_app.backpressure import proxy_hold as proxy_flow
    from serve_app.config.options import ServeConfig
    from serve_app.ingress import Ingress
    from serve_app.server_info import server_info

    if hooked:
        monkeypatch.setenv(proxy_flow.CALLBACK_ENV, proxy_flow.CALLBACK_PATH)
    else:
        monkeypatch.delenv(proxy_flow.CALLBACK_ENV, raising=False)
    config = ServeConfig(model=str(model_dirs("llama")), generations={"data_dir": str(tmp_path)})
    identity = served_identity(config, {"available": False})
    with caplog.at_level(logging.WARNING, logger="serve_app.ingress"):
        Ingress(config, FakeHandle(), FakeHandle(), FakeHandle(), identity)
    warnings = [r for r in caplog.records if r.getMessage() == proxy_flow.MISSING_HOOK_WARNING]
    assert len(warnings) == (0 if hooked else 1)
    info = server_info(config, identity)
    assert info["backpressure"]["stalled_client"]["detected"] is hooked


class FakeHandle:
    def options(self, **kwargs) -> FakeHandle:
        return self


def test_the_admin_port_is_waited_for_while_a_predecessor_holds_it_then_named():
    """A redeployed admin replica binds the port its predecessor is releasing; a port that
    stays taken fails the replica with a message naming it."""
    from serve_app.ops.admin_app import bind_listening
    from tests.support.ports import free_port

    port = free_port()
    holder = socket.create_server(("127.0.0.1", port))
    released = threading.Event()

    def release() -> None:
        holder.close()
        released.set()

    threading.Timer(0.5, release).start()
    with bind_listening("127.0.0.1", port, timeout_s=20) as sock:
        assert released.is_set() and sock.getsockname()[1] == port
        with pytest.raises(RuntimeError, match=f"admin_port: cannot listen on 127.0.0.1:{port}"):
            bind_listening("127.0.0.1", port, timeout_s=0.3)


def test_the_served_engine_takes_the_engine_defaults_it_does_not_override():
    """A served engine and `LLM(...)` batch the same way unless the config says otherwise."""
    import inspect

    from actors.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, SchedulerConfig
    from actors.llm import LLM
    from serve_app.config.options import EngineOptions

    served = EngineOptions()
    llm = inspect.signature(LLM).parameters
    assert served.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert llm["max_num_batched_tokens"].default == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert served.max_num_seqs == SchedulerConfig().max_num_seqs == llm["max_num_seqs"].default
    assert served.block_size == llm["block_size"].default
    assert served.kv_cache_bytes == llm["kv_cache_bytes"].default


def test_the_served_block_size_is_settled_before_the_graph_is_built(model_dirs):
    """The engine and /v1/server_info name one number: the config's, else the platform's."""
    from serve_app.app import settle_block_size
    from serve_app.config.options import ServeConfig

    model = str(model_dirs("llama"))
    assert settle_block_size(ServeConfig(model=model)).engine.block_size == 128  # no GPUs here
    on_gpus = ServeConfig(model=model, engine={"use_gpu": True})
    assert settle_block_size(on_gpus).engine.block_size == 16
    chosen = ServeConfig(model=model, engine={"block_size": 32})
    assert settle_block_size(chosen).engine.block_size == 32
