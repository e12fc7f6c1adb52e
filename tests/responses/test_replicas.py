"""Stored responses across ingress replicas and restarts: an app with two ingress replicas
(`ingress.num_replicas: 2`) answers from either (`x-served-by` names which); a response
created on one is retrieved, chained, resumed and cancelled on the other; a background
response outlives the ingress replica that accepted it; the app restarted on the same SQLite
data folder still has its responses, their chains and their events."""

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
STEP_DELAY_S = 0.02
# A grammar that makes the output long whatever the random model would say.
LONG_STORY = {
    "type": "json_schema",
    "name": "story",
    "schema": {
        "type": "object",
        "properties": {"story": {"type": "string", "minLength": 400, "maxLength": 450}},
        "required": ["story"],
        "additionalProperties": False,
    },
    "strict": True,
}


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
        # A slow model (not a slow machine): a long response is still running when its
        # ingress replica is killed.
        engine={"step_delay_s": STEP_DELAY_S},
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
        # No header: Serve's proxy answered itself (a replica that just died).
        if r.headers.get("x-served-by", first) != first:
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


def ingress_replica(replica_id: str):
    import ray

    name = f"SERVE_REPLICA::{APP}#ingress#{replica_id}"
    return ray.get_actor(name, namespace="serve")


def test_a_background_response_outlives_the_ingress_replica_that_accepted_it(
    replicas: Replicas,
):
    import ray

    url = replicas.url
    body = {"max_output_tokens": 600, "background": True, "text": {"format": LONG_STORY}}
    queued = create(url, **body)
    assert queued.status_code == 200, queued.text
    owner, rid = queued.headers["x-served-by"], queued.json()["id"]
    ray.kill(ingress_replica(owner), no_restart=True)
    # It was still running when the replica that accepted it died.
    running = on_another(owner, lambda: httpx.get(f"{url}/v1/responses/{rid}", timeout=30))
    assert running.json()["status"] in ("queued", "in_progress")
    # Read from the replica left (and Serve's replacement): it runs to its end.
    stream = httpx.get(f"{url}/v1/responses/{rid}", params={"stream": "true"}, timeout=120)
    events = events_of(stream)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed", final.get("error")
    story = json.loads(final["output"][-1]["content"][0]["text"])["story"]
    assert len(story) >= 400
    assert httpx.get(f"{url}/v1/responses/{rid}", timeout=30).json() == final


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
