"""Inputs that used to reach a 500 or a plain-text answer, over HTTP on the session's app:
each gets a 4xx in the one error shape with `x-should-retry: false`, and the server keeps
serving. Errors raised in other deployments (tokenizer, grammar) cross Ray whole."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.serve, pytest.mark.ray]

DEEP = 10_000
DEEP_ARRAY = "[" * DEEP + "]" * DEEP


def refusal(r: httpx.Response, status: int, code: str, param: str | None = "ANY") -> dict:
    """The error of a refused request, checked for shape and retry headers."""
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json"), r.text[:200]
    assert r.headers["x-should-retry"] == "false"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["code"] == code, error
    if param != "ANY":
        assert error["param"] == param, error
    return error


def send(url: str, path: str, body: dict | str | bytes, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else None
    if isinstance(body, str):
        content = body.encode()
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(
        url + path,
        json=body if isinstance(body, dict) else None,
        content=content,
        headers=headers,
        timeout=60,
        **kwargs,
    )


@pytest.fixture(scope="module")
def vocab_size(model_dirs) -> int:
    return json.loads((Path(model_dirs("llama")) / "config.json").read_text())["vocab_size"]


def chat(model_id: str, content: str = "hi", **fields) -> dict:
    return {"model": model_id, "messages": [{"role": "user", "content": content}], **fields}


# The four body-parsing endpoints, each as (path, a valid body with `text` inside, the param
# that names where the text went).
Endpoint = tuple[str, Callable[[str, str], dict], str]
ENDPOINTS: list[Endpoint] = [
    ("/v1/chat/completions", lambda m, t: chat(m, t, max_tokens=1), "messages.0.content"),
    ("/v1/completions", lambda m, t: {"model": m, "prompt": t, "max_tokens": 1}, "prompt"),
    ("/v1/generations", lambda m, t: {"profile": "support_reply_v3", "input": t}, "input"),
    (
        "/v1/conversations",
        lambda m, t: {"items": [{"role": "user", "content": t}]},
        "items.0.content",
    ),
]


def still_serves(serve_url: str, model_id: str) -> None:
    r = send(serve_url, "/v1/completions", {"model": model_id, "prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


# ----------------------------------------------------------- 1: errors across Ray hops


def test_token_ids_outside_the_vocabulary_are_400_from_the_tokenizer(
    serve_url: str, model_id: str, vocab_size: int
) -> None:
    import openai

    for ids in ([999_999_999], [vocab_size], [[1, 2], [3, vocab_size + 5]]):
        r = send(serve_url, "/v1/completions", {"model": model_id, "prompt": ids})
        error = refusal(r, 400, "invalid_request", "prompt")
        assert "outside the vocabulary" in error["message"]
    # The official client sees a 400 it does not retry (it would retry a 500 twice).
    client = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=2)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_id, prompt=[999_999_999])
    assert info.value.response.headers["x-should-retry"] == "false"
    still_serves(serve_url, model_id)


def test_template_kwargs_are_refused_by_name_from_the_tokenizer(
    serve_url: str, model_id: str
) -> None:
    # A kwarg naming an argument of the template call (here: the template itself) is not a
    # template variable; the tokenizer deployment refuses it and the refusal crosses Ray.
    kwargs = {"chat_template": "{{ raise_exception('owned') }}"}
    r = send(serve_url, "/v1/chat/completions", chat(model_id, chat_template_kwargs=kwargs))
    refusal(r, 400, "invalid_request", "chat_template_kwargs.chat_template")
    for value in ("maybe", 1, [True]):
        kwargs = {"enable_thinking": value}
        r = send(serve_url, "/v1/chat/completions", chat(model_id, chat_template_kwargs=kwargs))
        refusal(r, 400, "invalid_request", "chat_template_kwargs.enable_thinking")
    ok = chat(model_id, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
    assert send(serve_url, "/v1/chat/completions", ok).status_code == 200


def test_a_grammar_the_grammar_service_refuses_reaches_the_client_as_400(
    serve_url: str, model_id: str
) -> None:
    body = chat(model_id, max_tokens=4, structured_outputs={"regex": "[unclosed"})
    r = send(serve_url, "/v1/chat/completions", body)
    refusal(r, 400, "invalid_grammar", "structured_outputs.regex")


# ------------------------------------------------------------------ 2: deep JSON bodies


@pytest.mark.parametrize(("path", "make", "_param"), ENDPOINTS)
def test_deeply_nested_bodies_are_400_on_every_endpoint(
    serve_url: str, model_id: str, path: str, make, _param: str
) -> None:
    error = refusal(send(serve_url, path, DEEP_ARRAY), 400, "invalid_request", None)
    assert "max_json_depth" in error["message"]
    # Nested inside an otherwise valid body.
    body = json.dumps(make(model_id, "x"))[:-1] + ', "deep": ' + DEEP_ARRAY + "}"
    error = refusal(send(serve_url, path, body), 400, "invalid_request")
    assert "max_json_depth" in error["message"]


def test_a_deep_schema_given_as_a_string_is_400(serve_url: str, model_id: str) -> None:
    body = chat(model_id, max_tokens=4, structured_outputs={"json": DEEP_ARRAY})
    r = send(serve_url, "/v1/chat/completions", body)
    error = refusal(r, 400, "invalid_request", "structured_outputs.json")
    assert "max_json_depth" in error["message"]
    # `response_format.json_schema.schema` takes an object only: a string is a type error.
    schema = {"name": "deep", "schema": DEEP_ARRAY}
    response_format = {"type": "json_schema", "json_schema": schema}
    param = "response_format.json_schema.schema"
    body = chat(model_id, response_format=response_format)
    refusal(send(serve_url, "/v1/chat/completions", body), 400, "invalid_request", param)
    body = {"model": model_id, "prompt": "x", "response_format": response_format}
    refusal(send(serve_url, "/v1/completions", body), 400, "invalid_request", param)
    still_serves(serve_url, model_id)


def test_server_info_states_the_input_limits(serve_url: str) -> None:
    info = httpx.get(f"{serve_url}/v1/server_info").json()
    assert info["limits"]["max_json_depth"] == 128
    rules = info["request_input"]
    assert rules["X-Request-Id"]["max_chars"] == 256
    assert rules["Idempotency-Key"]["max_chars"] == 255
    assert "surrogate" in rules["text"]
    codes = {code for row in info["errors"] for code in row["codes"]}
    assert {"not_found", "method_not_allowed"} <= codes


# ----------------------------------------------------------------- 3: lone surrogates


@pytest.mark.parametrize(("path", "make", "param"), ENDPOINTS)
def test_a_lone_surrogate_is_400_naming_the_field(
    serve_url: str, model_id: str, path: str, make, param: str
) -> None:
    # json.dumps writes the lone surrogate as the escape "\ud800": valid JSON syntax.
    body = json.dumps(make(model_id, "before \ud800 after"))
    assert "\\ud800" in body
    error = refusal(send(serve_url, path, body), 400, "invalid_request", param)
    assert "surrogate" in error["message"]
    # A proper pair is text like any other.
    r = send(serve_url, path, json.dumps(make(model_id, "smile \U0001f600")))
    assert r.status_code in (200, 201), r.text[:300]


# ------------------------------------------------------------- 4: the router's answers


def test_unknown_routes_and_wrong_methods_answer_in_the_error_shape(serve_url: str) -> None:
    r = httpx.get(f"{serve_url}/v1/no/such/route")
    refusal(r, 404, "not_found", None)
    r = httpx.get(f"{serve_url}/v1/chat/completions")
    refusal(r, 405, "method_not_allowed", None)
    assert r.headers["allow"] == "POST"
    r = httpx.put(f"{serve_url}/v1/conversations/conv_x")
    refusal(r, 405, "method_not_allowed")
    assert set(r.headers["allow"].replace(" ", "").split(",")) >= {"GET", "DELETE"}


def test_serves_route_table_needs_a_key_once_keys_are_registered(serve_url: str) -> None:
    """The proxy's guard against the directory a keyed ingress fills: here the test plays
    that ingress (a keyed app of its own: tests/access/test_auth_http.py)."""
    from serve_app.access.keys import KeysFile, hash_key
    from serve_app.access.proxy_keys import register_keys, unregister_keys

    keys = KeysFile.model_validate(
        {"keys": [{"id": "k", "sha256": hash_key("sk-r"), "tenant": "t"}]}
    )
    owner = register_keys(keys)
    try:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
            r = httpx.get(f"{serve_url}/-/routes", headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key" and "serve-app" not in r.text
        r = httpx.get(f"{serve_url}/-/routes", headers={"Authorization": "Bearer sk-r"})
        assert r.status_code == 200 and "/" in r.json()
        # The load balancer's probe stays open and says nothing about the apps.
        r = httpx.get(f"{serve_url}/-/healthz")
        assert r.status_code == 200 and "serve-app" not in r.text
    finally:
        unregister_keys(owner)
    # Open again once no keyed app is registered (keyed apps that stopped took theirs out).
    assert httpx.get(f"{serve_url}/-/routes").status_code == 200


# ------------------------------------------------------------------------ 8: small ones


def test_a_huge_model_name_is_echoed_at_most_256_characters(serve_url: str, model_id: str) -> None:
    name = "m" * 100_000
    r = send(serve_url, "/v1/completions", {"model": name, "prompt": "x"})
    error = refusal(r, 404, "model_not_found", "model")
    assert "m" * 256 in error["message"] and len(error["message"]) < 400


def test_request_identity_headers_over_their_limits_are_400(serve_url: str, model_id: str) -> None:
    body = {"model": model_id, "prompt": "x", "max_tokens": 1}
    r = send(serve_url, "/v1/completions", body, headers={"X-Request-Id": "r" * 257})
    refusal(r, 400, "invalid_request", "X-Request-Id")
    body = {"profile": "support_reply_v3", "input": "x"}
    r = send(serve_url, "/v1/generations", body, headers={"Idempotency-Key": "k" * 256})
    refusal(r, 400, "invalid_request", "Idempotency-Key")
