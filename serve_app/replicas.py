"""Replica classes that live apart from the graph's module: a Serve replica imports the module
its class is defined in, and `serve_app.app` imports every deployment's (torch, transformers,
xgrammar). Defined there, the responses replica loaded all three and never used them: it came
up in 12.5-13.3 s on a 2-core host, against 5-6 s for the admin replica; here, 4.7-6.2 s."""

from __future__ import annotations

from typing import Any

from serve_app import ray_env
from serve_app.config.options import ServeConfig
from serve_app.responses.service import ResponseRunnerService


class ResponsesReplica(ResponseRunnerService):
    """The responses runner as a Serve replica. As in the ingress, the engine handle arrives
    with the options of the process that built the graph; the data plane is this replica's."""

    def __init__(
        self, config: ServeConfig, engine: Any, grammar: Any, identity: dict[str, Any]
    ) -> None:
        engine = engine.options(**ray_env.data_plane_options())
        # A compile's result goes to the engine as an object ref: always by reference.
        super().__init__(config, engine, grammar.options(_by_reference=True), identity)
