from __future__ import annotations

import json
import pickle
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
    (lambda: errors.engine_lost("rank 1 died"), 500, "engine_lost",
     "server_error", None, "false", None),
    (lambda: errors.engine_lost("rank 1 died", retryable=True), 500, "engine_lost",
     "server_error", None, "true", None),
    (lambda: errors.request_limit_exceeded("max_n", 9, 4, "n"), 400, "request_limit_exceeded",
     "invalid_request_error", "n", "false", None),
    (lambda: errors.profile_mismatch("model_not_allowed", "no", "model"), 400,
     "model_not_allowed", "invalid_request_error", "model", "false", None),
    (lambda: errors.route_not_found("/v2/nothing"), 404, "not_found",
     "not_found_error", None, "false", None),
    (lambda: errors.method_not_allowed("GET", "/v1/completions", ["POST"]), 405,
     "method_not_allowed", "invalid_request_error", None, "false", None),
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


@pytest.mark.parametrize(("make", "status", "code", "type_", "param", "retry", "after"), CASES)
def test_every_constructor_survives_pickling(make, status, code, type_, param, retry, after):
    """Ray ships a remote exception by pickle: the caller must get the same error back."""
    err = make()
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is APIError
    assert (back.status, back.code, back.message, back.param, back.type, back.headers) == (
        err.status, err.code, err.message, err.param, err.type, err.headers
    )  # fmt: skip
    assert str(back) == str(err)


def test_an_error_wrapped_by_ray_is_found_with_its_fields() -> None:
    from ray.exceptions import RayTaskError

    err = errors.invalid_request("token id 999999999 is outside the vocabulary", "prompt")
    wrapped = RayTaskError("render", "Traceback ...", err, proctitle="t", pid=1, ip="127.0.0.1")
    # Ray pickles the RayTaskError; the caller's side raises it as an instance of the cause.
    dual = pickle.loads(pickle.dumps(wrapped)).as_instanceof_cause()
    # What a Serve handle raises: both a RayTaskError and an APIError.
    assert isinstance(dual, RayTaskError) and isinstance(dual, APIError)
    found = errors.api_error_in(dual)
    assert found is not None and found.body() == err.body() and found.headers == err.headers
    # Wrapped again at a second hop, or chained by `raise ... from`.
    outer = RayTaskError("generate", "Traceback ...", dual, proctitle="t", pid=1, ip="127.0.0.1")
    assert errors.api_error_in(outer).body() == err.body()
    try:
        raise RuntimeError("lost") from dual
    except RuntimeError as chained:
        assert errors.api_error_in(chained).param == "prompt"
    assert errors.api_error_in(ValueError("plain")) is None


def test_client_text_is_echoed_at_most_256_characters() -> None:
    err = errors.route_not_found("/" + "x" * 100_000)
    assert len(err.message) < 400
    assert errors.echo("short") == "short"


def test_401_names_its_scheme() -> None:
    assert errors.invalid_api_key().headers["WWW-Authenticate"] == "Bearer"


def test_405_lists_the_allowed_methods() -> None:
    err = errors.method_not_allowed("GET", "/v1/chat/completions", ["POST"])
    assert err.response().headers["allow"] == "POST"


def test_a_starlette_app_answers_every_failure_in_the_error_shape() -> None:
    from ray.exceptions import RayTaskError
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    async def ok(request):
        return JSONResponse({})

    async def crash(request):
        raise RuntimeError("a bug")

    async def remote(request):
        # Ray's wrapper when it cannot make a dual instance: the APIError is only `.cause`.
        cause = errors.invalid_request("bad prompt", "prompt")
        raise RayTaskError("f", "tb", cause, proctitle="t", pid=1, ip="127.0.0.1")

    routes = [
        Route("/items/{i}", ok, methods=["GET"]),
        Route("/items/{i}", ok, methods=["DELETE"]),
        Route("/crash", crash),
        Route("/remote", remote),
    ]
    app = Starlette(routes=routes, exception_handlers=errors.exception_handlers())
    client = TestClient(app, raise_server_exceptions=False)
    r = client.put("/items/1")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    # Every route on the path counts, not only the first.
    assert {"GET", "DELETE"} <= set(r.headers["allow"].replace(" ", "").split(","))
    r = client.get("/nowhere")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert r.headers["x-should-retry"] == "false"
    r = client.get("/crash")
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert "a bug" not in r.text and r.headers["content-type"] == "application/json"
    r = client.get("/remote")
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
