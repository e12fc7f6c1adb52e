"""Retry headers with the official `openai` client at its default retry settings: every
response that must not be repeated says `x-should-retry: false`, so the client sends
exactly one attempt; capacity answers carry `Retry-After`."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest

pytestmark = pytest.mark.serve


class CountingTransport(httpx.BaseTransport):
    """Counts the requests that actually leave the client (each one reaches the server)."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.sent = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent += 1
        return self.inner.handle_request(request)


@pytest.fixture()
def counted(serve_url):
    """An openai client with its default retries (2), and the count of what it sent."""
    transport = CountingTransport()
    http = httpx.Client(transport=transport, timeout=60)
    client = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", http_client=http)
    assert client.max_retries == openai.DEFAULT_MAX_RETRIES == 2
    yield client, transport
    http.close()


def test_a_malformed_request_is_sent_once(counted, model_id):
    client, transport = counted
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=model_id, prompt="x", max_tokens=2, extra_body={"no_such_field": 1}
        )
    assert info.value.response.headers["x-should-retry"] == "false"
    assert info.value.code == "unknown_parameter"
    assert transport.sent == 1


def test_a_prompt_beyond_the_context_is_sent_once(counted, model_id):
    client, transport = counted
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_id, prompt="word " * 20000, max_tokens=2)
    assert info.value.code == "context_length_exceeded"
    assert transport.sent == 1


def test_a_live_request_id_conflict_is_sent_once(counted, serve_url, model_id):
    client, transport = counted
    rid = uuid.uuid4().hex
    long = {"model": model_id, "prompt": "long", "max_tokens": 900, "ignore_eos": True}
    with httpx.stream(
        "POST",
        f"{serve_url}/v1/completions",
        json={**long, "stream": True},
        headers={"X-Request-Id": rid},
    ) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)
        # openai retries 409 on its own unless the server says not to.
        with pytest.raises(openai.ConflictError) as info:
            client.completions.create(
                model=model_id,
                prompt="long",
                max_tokens=900,
                extra_body={"ignore_eos": True},
                extra_headers={"X-Request-Id": rid},
            )
    assert info.value.code == "request_id_in_use"
    assert info.value.response.headers["x-should-retry"] == "false"
    assert transport.sent == 1


def test_an_unknown_model_is_sent_once(counted):
    client, transport = counted
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert transport.sent == 1


def test_a_deadline_too_short_even_when_idle_is_sent_once(counted, serve_url, model_id):
    client, transport = counted
    # One request first, so the engine's cost model has measured a prefill.
    warm = {"model": model_id, "prompt": "word " * 300, "max_tokens": 2}
    assert httpx.post(f"{serve_url}/v1/completions", json=warm, timeout=60).status_code == 200
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=model_id,
            prompt="word " * 300,
            max_tokens=2,
            extra_headers={"X-Request-Timeout-Ms": "0.001"},
        )
    assert info.value.code == "deadline_too_short"
    assert transport.sent == 1
