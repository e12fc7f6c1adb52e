"""`wait_deployed`, what `serve-app serve` waits on after it deploys, on the session's Serve:
a running application returns, and one whose replicas cannot construct fails with Serve's
message instead of waiting out the load timeout."""

from __future__ import annotations

import time

import pytest
from ray import serve

from serve_app.app import APP_NAME
from serve_app.config.options import ServeConfig
from serve_app.placement import DeploymentFailed, application_status, wait_deployed

pytestmark = pytest.mark.serve


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Broken:
    def __init__(self) -> None:
        raise RuntimeError("this replica cannot start: no weights at /nowhere")


def test_a_running_app_returns_and_an_unknown_one_is_not_started(serve_url, model_path):
    config = ServeConfig(model=model_path)
    started = time.monotonic()
    wait_deployed(APP_NAME, config, {}, load_timeout_s=5)
    assert time.monotonic() - started < 5
    status, _ = application_status("no-such-app")
    assert status not in ("RUNNING", "DEPLOY_FAILED")


def test_replicas_that_cannot_construct_fail_the_wait_with_serves_message(serve_url, model_path):
    config = ServeConfig(model=model_path)
    # As `serve-app serve` deploys: without waiting for RUNNING.
    target = serve.RunTarget(Broken.bind(), name="broken", route_prefix="/broken")
    serve.run_many([target], wait_for_applications_running=False)
    try:
        started = time.monotonic()
        with pytest.raises(DeploymentFailed, match="no weights at /nowhere"):
            wait_deployed("broken", config, {}, load_timeout_s=120)
        assert time.monotonic() - started < 120
    finally:
        serve.delete("broken")
