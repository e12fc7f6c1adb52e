"""Idempotency keys in the shared resource layer: the header's rules and the repeat's answers
(the replay itself is the store's and the API's: test_store.py, test_generations_api.py)."""

from __future__ import annotations

import time

import pytest

from serve_app import errors
from serve_app.resources.idempotency import (
    MAX_IDEMPOTENCY_KEY_CHARS,
    idempotency_key,
    key_record,
    key_reused,
)


def test_a_key_is_trimmed_and_none_is_no_key():
    assert idempotency_key("  order-7 ") == "order-7"
    assert idempotency_key(None) is None


@pytest.mark.parametrize("header", ["", "   ", "x" * (MAX_IDEMPOTENCY_KEY_CHARS + 1), "a\x00b"])
def test_a_bad_key_is_400_naming_the_header(header):
    with pytest.raises(errors.APIError) as info:
        idempotency_key(header)
    assert (info.value.status, info.value.param) == (400, "Idempotency-Key")


def test_a_reused_key_is_a_conflict_not_to_retry_and_a_record_expires():
    err = key_reused()
    assert (err.status, err.code, err.headers["x-should-retry"]) == (
        409, "idempotency_key_reused", "false",
    )  # fmt: skip
    record = key_record("create_generation", "k", "sha256:ab", ttl_s=60)
    assert record.key == "k" and 59 < record.expires_at - time.time() <= 60
