"""Named, CPU-free helper actors (the stats registry, the usage ledger, the flow board): one
per name, created by whichever process needs it first, found by every other."""

from __future__ import annotations

from typing import Any


def get_or_create(cls: type, name: str, namespace: str, **options: Any) -> Any:
    """A handle to actor `name` in `namespace`, creating it from `cls` when it is missing."""
    import ray

    return (
        ray.remote(cls)
        .options(name=name, namespace=namespace, get_if_exists=True, num_cpus=0, **options)
        .remote()
    )
