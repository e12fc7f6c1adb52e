"""cluster.yaml is a launcher config `ray up` accepts, and it starts what the README says."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER_YAML = Path(__file__).resolve().parents[2] / "cluster.yaml"


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def _serve_command(config: dict) -> str:
    (command,) = [c for c in config["head_start_ray_commands"] if "serve-app serve" in c]
    return command


def test_validates_against_the_schema_ray_ships(config):
    validate_config(config)
    # As `ray up` does: merged with the provider's defaults, then validated again.
    validate_config(prepare_config(copy.deepcopy(config)))


def test_head_starts_ray_then_the_serve_app(config):
    commands = config["head_start_ray_commands"]
    start = next(i for i, c in enumerate(commands) if "ray start --head" in c)
    serve = commands.index(_serve_command(config))
    assert start < serve
    command = _serve_command(config)
    assert "--address auto" in command
    # A public bind is refused by the server without keys.
    assert "--host 0.0.0.0" in command and "--api-keys" in command
    assert "--store postgresql://" in command


def test_every_ray_start_has_the_environment_a_local_ray_gets(config):
    """The settings Serve's processes read when they start (flow middleware, gRPC data
    plane) come from the raylet's environment: each node's `ray start` must carry them."""
    from serve_app.ray_env import SETTINGS

    starts = [
        c
        for key in ("head_start_ray_commands", "worker_start_ray_commands")
        for c in config[key]
        if "ray start" in c
    ]
    assert len(starts) == 2
    for command in starts:
        env = command.split("ray start")[0]
        for name, value in SETTINGS.items():
            assert f"{name}={value}" in env.split(), (name, command)


def test_gpu_workers_are_sized_for_the_tp_degree(config):
    head = config["head_node_type"]
    workers = {k: v for k, v in config["available_node_types"].items() if k != head}
    gpus = [spec["resources"].get("GPU", 0) for spec in workers.values()]
    assert gpus and max(gpus) >= 4
    tp = int(re.search(r"--tp (\d+)", _serve_command(config)).group(1))
    assert tp <= max(gpus), "one replica's ranks must fit on one GPU node"
    assert config["available_node_types"][head]["resources"].get("GPU", 0) == 0


def test_setup_installs_torch_then_the_mounted_project(config):
    commands = config["setup_commands"]
    torch = next(i for i, c in enumerate(commands) if "pip install" in c and "torch" in c)
    project = next(i for i, c in enumerate(commands) if "pip install" in c and " -e " in c)
    assert torch < project
    target = commands[project].split(" -e ", 1)[1].split()[0]
    assert config["file_mounts"].get(target) == "."
