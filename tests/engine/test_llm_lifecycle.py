"""The offline LLM releases what it holds (close(), `with`, a finalizer for one dropped without
either), and a placement failure says what is free on each node and what holds the rest."""

from __future__ import annotations

import contextlib
import gc
import re
import time
import weakref
from collections.abc import Iterator

import pytest
from ray.util.placement_group import placement_group, remove_placement_group

from actors import LLM, LLMClosedError, SamplingParams
from actors.placement_failure import placement_failure_message

pytestmark = pytest.mark.ray

PROMPT = list(range(5, 30))
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@contextlib.contextmanager
def cluster_filled(ray, name: str, leave_cpus: float) -> Iterator[float]:
    """A placement group of ours holding every free CPU of the session's Ray but `leave_cpus`;
    yields how many it holds."""
    take = ray.available_resources().get("CPU", 0.0) - leave_cpus
    assert take > 0, ray.available_resources()
    group = placement_group([{"CPU": take}], name=name)
    ray.get(group.ready(), timeout=30)
    try:
        yield take
    finally:
        remove_placement_group(group)


def actor_state(actor_id: str) -> str:
    from ray._private import state

    return state.actors(actor_id)["State"]


def wait_until(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_closed_llm_frees_its_memory_and_refuses_work(model_dirs):
    with LLM(model=str(model_dirs("llama"))) as llm:
        assert llm.generate([PROMPT], GREEDY)[0].token_ids
        runner = weakref.ref(llm.engine.executor.worker.runner)
    assert llm.is_closed
    gc.collect()
    assert runner() is None, "the model and its KV cache outlived close()"
    llm.close()  # a second close is fine
    with pytest.raises(LLMClosedError, match="closed"):
        llm.generate([PROMPT], GREEDY)
    with pytest.raises(LLMClosedError):
        llm.stats()


def test_an_llm_dropped_without_close_is_collected_at_once(model_dirs):
    llm = LLM(model=str(model_dirs("llama")))
    alive = weakref.ref(llm)
    del llm
    # No reference cycle (the finalizer holds only the executor's resources): no gc needed.
    assert alive() is None


def test_tp_ranks_are_released_by_with_and_by_the_finalizer(ray_session, model_dirs):
    ray = ray_session
    path = str(model_dirs("llama"))
    # Room for exactly one TP=2 engine: a second one fits only once the first is released.
    with cluster_filled(ray, "rest-of-the-cluster", leave_cpus=2):
        with LLM(model=path, tensor_parallel_size=2) as first:
            expected = first.generate([PROMPT], GREEDY)[0].token_ids
            # Still open: a notebook cell re-run builds the new LLM before the name rebinds.
            with pytest.raises(RuntimeError) as failure:
                LLM(model=path, tensor_parallel_size=2, placement_timeout_s=1)
        message = str(failure.value)
        assert "it needs {'CPU': 2.0} on one node" in message
        assert re.search(r"free now: node \w+ \([^)]*\) has \{'CPU': 0\.0\} free of", message)
        assert "placement group 'rest-of-the-cluster'" in message
        assert "an LLM of this process that is still open: close() it" in message
        first.close()
        with pytest.raises(LLMClosedError):
            first.generate([PROMPT], GREEDY)

        # The first one's ranks are gone: the next one is placed at once and works.
        second = LLM(model=path, tensor_parallel_size=2, placement_timeout_s=10)
        assert second.generate([PROMPT], GREEDY)[0].token_ids == expected
        group_id = second.engine.executor.placement_group.id.hex()
        worker_ids = [w._actor_id.hex() for w in second.engine.executor.workers]
        del second
        gc.collect()
        assert ray.util.placement_group_table()[group_id]["state"] == "REMOVED"
        assert wait_until(lambda: all(actor_state(a) == "DEAD" for a in worker_ids))
        assert wait_until(lambda: ray.available_resources().get("CPU", 0.0) >= 2)


def test_placement_failure_names_what_is_free_and_who_holds_the_rest(ray_session, model_dirs):
    ray = ray_session

    @ray.remote(num_cpus=1)
    class Holder:
        def ping(self) -> bool:
            return True

    holder = Holder.options(name="cpu-holder").remote()
    try:
        ray.get(holder.ping.remote(), timeout=60)
        filled = cluster_filled(ray, "filler", leave_cpus=1)
        with filled as taken, pytest.raises(RuntimeError) as failure:
            LLM(model=str(model_dirs("llama")), tensor_parallel_size=2, placement_timeout_s=1)
    finally:
        ray.kill(holder)
    message = str(failure.value)
    total = {"CPU": ray.cluster_resources()["CPU"]}
    assert "(STRICT_PACK) could not be placed within 1s" in message
    assert f"the largest of the 1 nodes has {total} in total;" in message
    # One CPU is left free, and the two ranks need two on one node.
    assert f"has {{'CPU': 1.0}} free of {total}" in message
    assert f"placement group 'filler' {{'CPU': {round(taken, 3)}}}" in message
    assert re.search(r"actor cpu-holder \(pid \d+\) \{'CPU': 1\.0\}", message)
    # Nothing of the failed attempt is left waiting to be placed.
    states = [g["state"] for g in ray.util.placement_group_table().values()]
    assert "PENDING" not in states


def test_a_group_no_node_can_hold_says_so(ray_session):
    total = ray_session.cluster_resources()["CPU"]
    message = placement_failure_message([{"CPU": 1.0}] * int(total + 1), "STRICT_PACK", 2)
    assert f"it needs {{'CPU': {total + 1}}} on one node" in message
    assert f"the largest of the 1 nodes has {{'CPU': {total}}} in total, so it cannot" in message
    assert "held by" not in message
