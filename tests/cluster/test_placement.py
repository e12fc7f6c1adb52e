"""What each deployment asks Ray for, decided from the config (no Ray needed)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serve_app.app import cpu_actor_options, engine_placement
from serve_app.config.options import ServeConfig
from serve_app.placement import requested_bundles


@pytest.fixture(scope="module")
def model(model_dirs) -> str:
    return str(model_dirs("llama"))


def _config(model: str, **engine) -> ServeConfig:
    return ServeConfig(model=model, engine=engine)


def test_tp_replica_is_one_strict_pack_group_with_a_gpu_per_rank(model):
    options = engine_placement(_config(model, tensor_parallel_size=2, use_gpu=True))
    rank = {"GPU": 1.0, "CPU": 1.0}
    assert options == {
        "placement_group_bundles": [{"CPU": 1.0}, rank, rank],
        "placement_group_strategy": "STRICT_PACK",
    }


def test_cross_node_ranks_are_an_opt_in(model):
    config = _config(model, tensor_parallel_size=2, use_gpu=True, placement_strategy="PACK")
    assert engine_placement(config)["placement_group_strategy"] == "PACK"
    with pytest.raises(ValidationError, match="placement_strategy"):
        _config(model, placement_strategy="ANYWHERE")


def test_cpu_engines_and_single_rank_gpu_replicas(model):
    cpu = engine_placement(_config(model, tensor_parallel_size=2, use_gpu=False))
    assert cpu["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}]
    gpu1 = engine_placement(_config(model, use_gpu=True, replica_cpus=4))
    assert gpu1 == {"ray_actor_options": {"num_cpus": 4.0, "num_gpus": 1}}
    assert requested_bundles(gpu1) == [{"CPU": 4.0, "GPU": 1.0}]


def test_cpu_deployments_ask_for_no_gpu_and_the_head_unless_told_otherwise(model):
    on_head = cpu_actor_options(ServeConfig(model=model))
    assert on_head == {"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}}
    anywhere = cpu_actor_options(ServeConfig(model=model, cpu_deployments_on_head=False))
    assert anywhere == {"num_cpus": 0}


def test_a_request_fits_the_cluster_only_if_some_node_could_ever_hold_it(monkeypatch):
    from serve_app import placement

    gpu_node = {"Alive": True, "Resources": {"CPU": 2.0, "GPU": 2.0}}
    head = {"Alive": True, "Resources": {"CPU": 2.0}}
    dead = {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}}
    monkeypatch.setattr(placement.ray, "nodes", lambda: [head, gpu_node, gpu_node, dead])
    rank = {"GPU": 1.0, "CPU": 1.0}
    # Busy or still starting is not unplaceable: two ranks fit one 2-GPU node in total.
    assert placement.fits_the_cluster([{"CPU": 1.0}, rank], "STRICT_PACK")
    # Four ranks packed on one node fit none (the dead node does not count).
    assert not placement.fits_the_cluster([{"CPU": 1.0}, rank, rank, rank, rank], "STRICT_PACK")
    # Spread, each bundle only needs some node.
    assert placement.fits_the_cluster([rank] * 4, "SPREAD")
    assert not placement.fits_the_cluster([{"GPU": 4.0}], "one actor")
