from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

# ---------------------------------------------------------------- factory checkpoints

ModelDirs = Callable[..., Path]


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> ModelDirs:
    """`model_dirs(arch, preset="tiny", seed=0)` -> a checkpoint built once per session."""
    # Imported here so collecting tests that need no model does not pay for torch.
    from serve_app.model_factory import make_model

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
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
