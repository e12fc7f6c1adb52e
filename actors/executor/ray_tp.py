"""Tensor parallelism over Ray: one worker actor per rank inside a placement group.

Inside a Serve replica or a Ray Data actor the current placement group is used (bundle 0 is
the replica itself, ranks take the bundles after it); elsewhere the executor creates one.
Each step is one `execute` call per rank with the same StepInput (a constrained step: `forward`
on every rank, then `sample` on rank 0 with the masks filled meanwhile).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

import ray
from ray.exceptions import GetTimeoutError, RayError
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.config import CacheConfig, ModelConfig, ParallelConfig
from actors.executor.base import Executor, ExecutorError, wait_for_masks
from actors.executor.worker import RayWorkerShell
from actors.mask_buffer import check_ranks_agree
from actors.messages import GrammarMasks, StepInput, StepOutput
from actors.placement_failure import executor_group_name, placement_failure_message
from actors.spec_decode.config import SpeculativeConfig
from actors.spec_decode.draft import DraftRequest

logger = logging.getLogger(__name__)


def _bundle_resource(bundle: dict[str, float]) -> dict[str, float]:
    """The rank asks for its whole bundle (GPU ranks hold their GPU; CPUs become threads)."""
    return {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0)}


def rank_bundles(tp: int, use_gpu: bool) -> list[dict[str, float]]:
    return [{"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 1.0} for _ in range(tp)]


def cluster_has_gpus() -> bool:
    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def bundles_use_gpu(use_gpu: bool | None) -> bool:
    """Whether rank bundles ask for a GPU: `use_gpu` (`ParallelConfig`'s, the serve config's
    `engine.use_gpu`), else whether the cluster has GPUs."""
    return cluster_has_gpus() if use_gpu is None else use_gpu


class RankResources:
    """What an executor holds outside this process: its rank actors and the placement group
    it created (None when it runs in its caller's group). Holds nothing else, so a finalizer
    may keep it without keeping the executor or its owner alive."""

    def __init__(self) -> None:
        self.workers: list[ray.actor.ActorHandle] = []
        self.placement_group: PlacementGroup | None = None

    def release(self) -> None:
        """Kill the ranks and remove the group; idempotent, and safe once Ray is gone."""
        workers, self.workers = self.workers, []
        group, self.placement_group = self.placement_group, None
        if not ray.is_initialized():
            return  # Ray's shutdown already took them.
        for w in workers:
            # An already dead worker is fine.
            with contextlib.suppress(Exception):
                ray.kill(w)
        if group is not None:
            try:
                remove_placement_group(group)
            except Exception as exc:  # noqa: BLE001 (e.g. a group of an earlier Ray session)
                logger.warning("could not remove placement group %s: %s", group.id.hex(), exc)


class RayExecutor(Executor):
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        parallel_config: ParallelConfig,
        seed: int = 0,
        speculative_config: SpeculativeConfig | None = None,
    ):
        if not ray.is_initialized():
            ray.init(address="local", log_to_driver=False)
        self.tp = parallel_config.tensor_parallel_size
        self._healthy = True
        self.held = RankResources()
        pg, first_bundle = self._placement_group(parallel_config)
        bundles = pg.bundle_specs
        try:
            for rank in range(self.tp):
                bundle = bundles[first_bundle + rank]
                resources = _bundle_resource(bundle)
                actor = ray.remote(RayWorkerShell).options(
                    **resources,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=first_bundle + rank
                    ),
                )
                self.held.workers.append(actor.remote(int(bundle.get("CPU", 0))))
            address = ray.get(self.workers[0].rendezvous_address.remote())
            self._all(
                lambda rank, w: w.init_worker.remote(
                    model_config, cache_config, rank, self.tp, address, seed, speculative_config
                )
            )
        except BaseException:
            self.shutdown()
            raise

    def _placement_group(self, config: ParallelConfig) -> tuple[PlacementGroup, int]:
        current = get_current_placement_group()
        if current is not None:
            n = len(current.bundle_specs)
            if n >= self.tp + 1:
                return current, 1
            if n == self.tp:
                return current, 0
            raise ValueError(
                f"tensor_parallel_size ({self.tp}) needs {self.tp} bundles after the replica's "
                f"own, but its placement group has {n}"
            )
        bundles = rank_bundles(self.tp, bundles_use_gpu(config.use_gpu))
        pg = placement_group(
            bundles, strategy=config.placement_strategy, name=executor_group_name()
        )
        try:
            ray.get(pg.ready(), timeout=config.placement_timeout_s)
        except GetTimeoutError:
            # Described while the group still waits, so the message sees the cluster as it was.
            message = placement_failure_message(
                bundles, config.placement_strategy, config.placement_timeout_s
            )
            remove_placement_group(pg)
            raise RuntimeError(message) from None
        except BaseException:
            # e.g. Ctrl-C in a notebook during the wait: a group left behind would be placed
            # later and hold its resources for the rest of the driver's life.
            remove_placement_group(pg)
            raise
        self.held.placement_group = pg
        return pg, 0

    @property
    def workers(self) -> list[ray.actor.ActorHandle]:
        return self.held.workers

    @property
    def placement_group(self) -> PlacementGroup | None:
        """The group this executor created and removes at shutdown (None: the caller's)."""
        return self.held.placement_group

    def _all(self, call, timeout: float | None = None) -> list:
        """Run `call(rank, worker)` on every rank; the first failure raises at once."""
        return _gather([call(rank, w) for rank, w in enumerate(self.workers)], timeout)

    def determine_num_blocks(self) -> int:
        return min(self._all(lambda _, w: w.determine_num_blocks.remote()))

    def init_kv_cache(self, num_blocks: int) -> None:
        self._all(lambda _, w: w.init_kv_cache.remote(num_blocks))

    def register_vocab_mask_buffer(self, num_rows: int) -> tuple[int, ...]:
        shapes = self._all(lambda _, w: w.register_vocab_mask_buffer.remote(num_rows))
        check_ranks_agree(shapes)
        return shapes[0]

    def execute(self, step: StepInput, masks: Future[GrammarMasks] | None = None) -> StepOutput:
        """One call per rank; with grammar masks, two: the forward goes out first, the masks
        follow to rank 0 (the sampling rank) once filled, and each actor runs them in order."""
        if not self._healthy:
            wait_for_masks(masks)
            raise ExecutorError("a tensor-parallel worker was lost earlier")
        try:
            if masks is None:
                return self._all(lambda _, w: w.execute.remote(step))[0]
            try:
                refs = [w.forward.remote(step) for w in self.workers]
            finally:
                filled = wait_for_masks(masks)
            # The other ranks' forward keeps its logits until their next step replaces them.
            return _gather([self.workers[0].sample.remote(filled), *refs], None)[0]
        except (RayError, GetTimeoutError) as exc:
            self._healthy = False
            raise ExecutorError(f"tensor-parallel worker failed: {exc}") from exc

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        if not self._healthy:
            raise ExecutorError("a tensor-parallel worker was lost earlier")
        try:
            return self._all(lambda _, w: w.propose.remote(requests))[0]
        except (RayError, GetTimeoutError) as exc:
            self._healthy = False
            raise ExecutorError(f"tensor-parallel worker failed: {exc}") from exc

    def is_healthy(self) -> bool:
        if not self._healthy:
            return False
        try:
            self._all(lambda _, w: w.ping.remote(), timeout=10)
        except (RayError, GetTimeoutError):
            self._healthy = False
        return self._healthy

    def shard_info(self) -> list[dict[str, object]]:
        return self._all(lambda _, w: w.shard_info.remote())

    def measure_step_overhead(self, repeats: int = 20) -> float:
        """Seconds of one round trip to every rank with an empty step (no model work)."""
        self.execute(StepInput(items=[]))
        start = time.perf_counter()
        for _ in range(repeats):
            self.execute(StepInput(items=[]))
        return (time.perf_counter() - start) / repeats

    def shutdown(self) -> None:
        self.held.release()

    def releaser(self) -> Callable[[], None]:
        return self.held.release


def _gather(refs: list, timeout: float | None) -> list:
    """The results of `refs` in order; the first failure raises at once, not after the rest."""
    results: dict = {}
    pending = list(refs)
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            raise GetTimeoutError(f"ranks did not answer within {timeout}s")
        for ref in ready:
            results[ref] = ray.get(ref)
    return [results[r] for r in refs]
