"""Idempotency keys, for every API family that creates resources: the header's rules, the
key a resource is recorded with, and the answers a repeat gets.

The store records a key with the request's body hash in the same transaction as the resource
(`serve_app.store`): a repeat with the same body replays the resource (200/202 with
`Idempotent-Replayed: true`, never a second run); the same key with another body is a 409
the client must not retry.
"""

from __future__ import annotations

import time

from serve_app import errors
from serve_app.store.base import IdempotencyKey

HEADER = "Idempotency-Key"
MAX_IDEMPOTENCY_KEY_CHARS = 255
REPLAYED_HEADER = "Idempotent-Replayed"


def idempotency_key(header: str | None) -> str | None:
    """The request's key (None: it sent none), or 400 naming the header."""
    if header is None:
        return None
    key = header.strip()
    if not key or len(key) > MAX_IDEMPOTENCY_KEY_CHARS or not key.isprintable():
        raise errors.invalid_request(
            f"{HEADER} must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} printable characters", HEADER
        )
    return key


def key_record(operation: str, key: str, body_hash: str, ttl_s: float) -> IdempotencyKey:
    """What the store keeps for `key`: the operation, the body it came with, when it expires."""
    return IdempotencyKey(operation, key, body_hash, time.time() + ttl_s)


def key_reused() -> errors.APIError:
    return errors.conflict(
        "idempotency_key_reused",
        f"This {HEADER} was used with a different request; use a new key for new work.",
    )
