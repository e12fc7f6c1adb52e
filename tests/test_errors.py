from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from serve_app import errors
from serve_app.errors import TAXONOMY, APIError

# (constructor, status, code, type, param, x-should-retry, Retry-After)
CASES: list[tuple[Callable[[], APIError], int, str, str, str | None, str, str | None]] = [
    (lambda: errors.invalid_request("bad", "temperature"), 400, "invalid_request",
     "invalid_request_error", "temperature", "false", None),
    (lambda: errors.invalid_request("bad"), 400, "invalid_request",
     "invalid_request_error", None, "false", None),
    (lambda: errors.unknown_parameter("foo"), 400, "unknown_parameter",
     "invalid_request_error", "foo", "false", None),
    (lambda: errors.unsupported_parameter("logit_bias", "no"), 400, "unsupported_parameter",
     "invalid_request_error", "logit_bias", "false", None),
    (lambda: errors.invalid_grammar("Unclosed '['", "structured_outputs.regex"), 400,
     "invalid_grammar", "invalid_request_error", "structured_outputs.regex", "false", None),
    (lambda: errors.deadline_too_short("needs 3 s"), 400, "deadline_too_short",
     "invalid_request_error", "timeout", "false", None),
    (lambda: errors.context_length_exceeded("too long"), 400, "context_length_exceeded",
     "invalid_request_error", "messages", "false", None),
    (lambda: errors.context_length_exceeded("too long", status=422, param="input"), 422,
     "context_length_exceeded", "invalid_request_error", "input", "false", None),
    (lambda: errors.max_tokens_exceeded("too many"), 400, "max_tokens_exceeded",
     "invalid_request_error", "max_tokens", "false", None),
    (lambda: errors.max_tokens_exceeded("too many", status=422), 422, "max_tokens_exceeded",
     "invalid_request_error", "max_tokens", "false", None),
    (lambda: errors.invalid_api_key(), 401, "invalid_api_key",
     "authentication_error", None, "false", None),
    (lambda: errors.permission_denied("model_not_permitted", "no"), 403, "model_not_permitted",
     "permission_error", None, "false", None),
    (lambda: errors.not_found("model_not_found", "no such model", "model"), 404,
     "model_not_found", "not_found_error", "model", "false", None),
    (lambda: errors.not_found("generation_not_found", "no"), 404, "generation_not_found",
     "not_found_error", None, "false", None),
    (lambda: errors.conflict("request_id_in_use", "live"), 409, "request_id_in_use",
     "conflict_error", None, "false", None),
    (lambda: errors.conflict("idempotency_key_reused", "x"), 409, "idempotency_key_reused",
     "conflict_error", None, "false", None),
    (lambda: errors.conflict("stale_revision", "x"), 409, "stale_revision",
     "conflict_error", None, "false", None),
    (lambda: errors.body_too_large(1024), 413, "body_too_large",
     "invalid_request_error", None, "false", None),
    (lambda: errors.limit_exceeded("concurrency_limit", "8 live", 2.0), 429,
     "concurrency_limit", "rate_limit_error", None, "true", "2"),
    (lambda: errors.limit_exceeded("token_rate_limit", "x", 0.2), 429, "token_rate_limit",
     "rate_limit_error", None, "true", "1"),
    (lambda: errors.overloaded("queue full", 2.5), 503, "overloaded",
     "overloaded_error", None, "true", "3"),
    (lambda: errors.deadline_unmeetable("queue too long", 0), 503, "deadline_unmeetable",
     "overloaded_error", None, "true", "1"),
    (lambda: errors.internal_error("boom"), 500, "internal_error",
     "server_error", None, "false", None),
    (lambda: errors.internal_error("boom", retryable=True), 500, "internal_error",
     "server_error", None, "true", None),
]  # fmt: skip


@pytest.mark.parametrize(("make", "status", "code", "type_", "param", "retry", "after"), CASES)
def test_constructor(make, status, code, type_, param, retry, after) -> None:
    err = make()
    assert (err.status, err.code, err.type, err.param) == (status, code, type_, param)
    assert err.headers.get("x-should-retry") == retry
    assert err.headers.get("Retry-After") == after
    assert err.body() == {
        "error": {"message": err.message, "type": type_, "code": code, "param": param}
    }
    assert err.message and str(err) == err.message


@pytest.mark.parametrize(("make", "status", "code", "type_", "param", "retry", "after"), CASES)
def test_response_carries_body_status_and_headers(
    make, status, code, type_, param, retry, after
) -> None:
    err = make()
    response = err.response()
    assert response.status_code == status
    assert json.loads(response.body) == err.body()
    assert response.headers["x-should-retry"] == retry
    assert response.headers.get("retry-after") == after


def test_every_4xx_refuses_retries_and_429_503_ask_for_them() -> None:
    for make, status, *_ in CASES:
        err = make()
        if 400 <= status < 500 and status != 429:
            assert err.headers["x-should-retry"] == "false", err
            assert not err.should_retry
        if status in (429, 503):
            assert int(err.headers["Retry-After"]) >= 1
            assert err.should_retry


def test_infinite_retry_after_still_gives_whole_seconds() -> None:
    assert errors.overloaded("x", float("inf")).headers["Retry-After"] == "1"


def test_too_large_status_is_400_or_422_only() -> None:
    with pytest.raises(ValueError):
        errors.context_length_exceeded("x", status=413)


def test_error_is_an_exception_that_keeps_its_fields() -> None:
    with pytest.raises(APIError) as info:
        raise errors.unknown_parameter("foo")
    assert info.value.param == "foo"
    assert "unknown_parameter" in repr(info.value)


def test_taxonomy_is_json_data_covering_every_constructor_code() -> None:
    json.dumps(TAXONOMY)
    codes_by_status: dict[int, set[str]] = {}
    for row in TAXONOMY:
        assert {"class", "status", "type", "client_action", "codes"} <= set(row)
        for status in row["status"]:
            codes_by_status.setdefault(status, set()).update(row["codes"])
    for _make, status, code, type_, *_ in CASES:
        assert code in codes_by_status[status], (status, code)
        assert errors.ERROR_TYPES[status] == type_


def test_taxonomy_rows_agree_with_headers() -> None:
    for row in TAXONOMY:
        if row["status"] in ([429], [503]):
            assert row["should_retry"] is True and row["retry_after"] is True
        elif row["status"] != [500]:
            assert row["should_retry"] is False
