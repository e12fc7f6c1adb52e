"""The cases, one module per concern; importing this package registers them."""

from __future__ import annotations

from serve_app.conformance.cases import (  # noqa: F401  (each module registers its cases)
    errors,
    generations,
    identity,
    lifecycle,
    responses,
    sampling,
    streaming,
    structured,
)
from serve_app.conformance.cases.base import REGISTRY, Case

# The order cases run and are listed in: what the server is, then what it generates, then
# how it refuses, then the task family's resources and the Responses family, then a
# request's life (the slowest last).
MODULE_ORDER = (
    "identity",
    "streaming",
    "sampling",
    "structured",
    "errors",
    "generations",
    "responses",
    "lifecycle",
)


def ordered() -> list[Case]:
    def position(c: Case) -> int:
        return MODULE_ORDER.index(c.run.__module__.rpartition(".")[2])

    return sorted(REGISTRY, key=position)  # stable: a module's cases keep their order


def select(ids: list[str] | None = None, fast: bool = False) -> list[Case]:
    """The cases to run, in order: the named ones, the fast subset, or all."""
    cases = ordered()
    if ids:
        unknown = sorted(set(ids) - {c.id for c in cases})
        if unknown:
            raise ValueError(f"unknown cases: {unknown}; known: {[c.id for c in cases]}")
        return [c for c in cases if c.id in ids]
    return [c for c in cases if c.fast or not fast]
