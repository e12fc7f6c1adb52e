"""Stored responses across ingress replicas and restarts: an app with two ingress replicas
(`ingress.num_replicas: 2`) answers from either (`x-served-by` names which); a response
created on one is retrieved, chained, resumed and cancelled on the other; the app restarted
on the same SQLite data folder still has its responses, their chains and their events."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest

from serve_app.config.options import ServeConfig
from tests.support import side_apps

pytestmark = [pytest.mark.serve, pytest.mark.ray, pytest.mark.timeout(600)]

APP = "serve-app-replicas"
PREFIX = "/replicas"
MODEL = "replicas-tiny"
# Serve's proxy picks a replica per request: this many tries find the other one.
MAX_TRIES = 60


@dataclass(frozen=True)
class Replicas:
    url: str
    config: ServeConfig


@pytest.fixture(scope="module")
def replicas(serve_url, ray_session, model_dirs, tmp_path_factory) -> Iterator[Replicas]:
    from ray import serve

    config = side_apps.side_config(
        model_dirs("llama"), MODEL, tmp_path_factory.mktemp("replicas-data"),
        ingress={"num_replicas": 2},
    )  # fmt: skip
    url = f"{serve_url}{PREFIX}"
    try:
        side_apps.deploy(config, APP, url, PREFIX)
        yield Replicas(url, config)
    finally:
        serve.delete(APP)


def on_another(first: str, call: Callable[[], httpx.Response]) -> httpx.Response:
    """`call` repeated until a replica other than `first` answers it."""
    for _ in range(MAX_TRIES):
        r = call()
        if r.headers["x-served-by"] != first:
            return r
    raise AssertionError(f"only {first} answered {MAX_TRIES} tries")


def create(url: str, **fields) -> httpx.Response:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 6, "temperature": 0.0, **fields}
    return httpx.post(f"{url}/v1/responses", json=body, timeout=60)


def events_of(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]


def test_a_response_made_on_one_replica_is_read_chained_and_resumed_on_the_other(
    replicas: Replicas,
):
    url = replicas.url
    made = create(url, stream=True)
    assert made.status_code == 200
    first = made.headers["x-served-by"]
    events = events_of(made)
    rid = events[0]["response"]["id"]
    got = on_another(first, lambda: httpx.get(f"{url}/v1/responses/{rid}", timeout=30))
    assert got.status_code == 200 and got.json() == events[-1]["response"]
    resumed = on_another(
        first,
        lambda: httpx.get(
            f"{url}/v1/responses/{rid}", params={"stream": "true", "starting_after": 2}, timeout=30
        ),
    )
    assert events_of(resumed) == events[3:]
    chained = on_another(first, lambda: create(url, previous_response_id=rid))
    assert chained.status_code == 200
    assert chained.json()["usage"]["input_tokens"] > events[-1]["response"]["usage"]["input_tokens"]
    # A background response cancelled through the replica that does not run it.
    body = {"max_output_tokens": 400, "temperature": 1.0, "background": True}
    queued = create(url, **body)
    owner, qid = queued.headers["x-served-by"], queued.json()["id"]
    cancelled = on_another(
        owner, lambda: httpx.post(f"{url}/v1/responses/{qid}/cancel", timeout=60)
    )
    assert cancelled.status_code == 200
    # Cancelled, unless it ended first (completion may win the race); either way it is over.
    assert cancelled.json()["status"] in ("cancelled", "completed", "incomplete")
    assert cancelled.json()["usage"]["input_tokens"] > 0


def test_responses_and_chains_survive_a_restart_on_the_same_sqlite_folder(replicas: Replicas):
    from ray import serve

    url = replicas.url
    first = create(url).json()
    second = create(url, previous_response_id=first["id"]).json()
    stream = httpx.get(f"{url}/v1/responses/{second['id']}", params={"stream": "true"}, timeout=30)
    serve.delete(APP)
    side_apps.deploy(replicas.config, APP, url, PREFIX)
    assert httpx.get(f"{url}/v1/responses/{second['id']}", timeout=30).json() == second
    again = httpx.get(f"{url}/v1/responses/{second['id']}", params={"stream": "true"}, timeout=30)
    assert events_of(again) == events_of(stream)
    third = create(url, previous_response_id=second["id"])
    assert third.status_code == 200
    assert third.json()["usage"]["input_tokens"] > second["usage"]["input_tokens"]
