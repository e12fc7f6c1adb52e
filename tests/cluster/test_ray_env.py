"""The environment a local Ray starts with, and the data plane the ingress's handles use."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from serve_app import ray_env
from serve_app.backpressure import proxy_hold as proxy_flow


def test_prepare_sets_what_is_missing_and_keeps_an_operators_choice(monkeypatch):
    monkeypatch.delenv(ray_env.GRPC_ENV, raising=False)
    monkeypatch.setenv(proxy_flow.CALLBACK_ENV, "my.own:callback")
    ray_env.prepare()
    assert ray_env.grpc_data_plane()
    assert not proxy_flow.is_enabled()  # the operator's callback stays

    monkeypatch.setenv(ray_env.GRPC_ENV, "0")
    ray_env.prepare()
    assert not ray_env.grpc_data_plane()


def _child_policy() -> int:
    code = "import os; print(os.sched_getscheduler(0))"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True).stdout)


def test_ray_started_inside_runs_sched_batch_and_the_starting_thread_keeps_its_policy(
    monkeypatch,
):
    # What a local Ray's proxy, replicas and daemons inherit from the thread that starts it.
    monkeypatch.delenv(ray_env.BATCH_SCHEDULING_ENV, raising=False)
    before = os.sched_getscheduler(0)
    with ray_env.batch_scheduled_children():
        assert _child_policy() == os.SCHED_BATCH
    assert os.sched_getscheduler(0) == before
    assert _child_policy() == before

    monkeypatch.setenv(ray_env.BATCH_SCHEDULING_ENV, "0")  # the operator keeps the normal one
    with ray_env.batch_scheduled_children():
        assert _child_policy() == before


class FakeHandle:
    """A deployment handle that records the options it was given."""

    def __init__(self, name: str, options: dict | None = None):
        self.name = name
        self.given = options or {}

    def options(self, **kwargs) -> FakeHandle:
        return FakeHandle(self.name, {**self.given, **kwargs})


@pytest.mark.parametrize("grpc", ["1", "0"])
def test_the_ingress_streams_on_its_own_nodes_data_plane(grpc, monkeypatch, model_dirs, tmp_path):
    """Handles built by the driver carry the driver's transport; the ingress re-decides from
    its own environment. Grammar compiles stay by reference whatever it is: the engine
    awaits their object refs while it prefills."""
    from serve_app.app import served_identity
    from serve_app.config.options import ServeConfig
    from serve_app.config.profiles import GenerationOptions
    from serve_app.ingress import Ingress

    monkeypatch.setenv(ray_env.GRPC_ENV, grpc)
    options = GenerationOptions(data_dir=str(tmp_path))
    config = ServeConfig(model=str(model_dirs("llama")), generations=options)
    identity = served_identity(config, {"available": False})
    handles = [FakeHandle(n) for n in ("tokenizer", "grammar", "engine")]
    ingress = Ingress(config, *handles, identity)

    by_reference = grpc != "1"
    # Over gRPC the engine's outputs come by Serve's `pickle`; its requests stay in
    # cloudpickle, which hands a grammar's ObjectRef over with its ownership.
    serializer = None if by_reference else "pickle"
    streams = [ingress._engine, ingress.openai.engine, ingress.generations.runner.engine]
    for handle in streams:
        assert handle.name == "engine"
        assert handle.given.get("_by_reference") is by_reference
        assert "request_serialization" not in handle.given
        assert handle.given.get("response_serialization") == serializer
    assert ingress.openai.tokenizer.given.get("_by_reference") is by_reference
    for grammar in (ingress.openai.admission.grammar, ingress.generations.runner.grammar):
        assert grammar.given == {"_by_reference": True}


def test_direct_ingress_gives_the_ingress_replica_the_servers_port(monkeypatch):
    for name in ray_env.direct_ingress_settings(0):
        monkeypatch.setenv(name, "")  # recorded, so what prepare() sets is undone after
        monkeypatch.delenv(name)
    with pytest.raises(RuntimeError, match="direct_ingress: this Ray's Serve"):
        ray_env.refuse_missing_direct_ingress(True, 8123)
    ray_env.refuse_missing_direct_ingress(False, 8123)  # not asked: nothing to check

    ray_env.prepare(8123)
    assert ray_env.serves_direct_ingress(8123)
    ray_env.refuse_missing_direct_ingress(True, 8123)
    with pytest.raises(RuntimeError, match="MIN_HTTP_PORT=9000"):
        ray_env.refuse_missing_direct_ingress(True, 9000)  # Serve binds another port


def test_direct_ingress_needs_a_fixed_port(model_dirs):
    from serve_app.config.options import ServeConfig

    with pytest.raises(ValueError, match="port: direct_ingress needs a fixed port"):
        ServeConfig(model=str(model_dirs("llama")), port=0, direct_ingress=True)
