"""Ingress deployment: routes only. Each route hands off to its API family's handlers."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serve_app import errors, ray_env
from serve_app.access.keys import principal_of
from serve_app.access.middleware import access_middleware
from serve_app.access.proxy_keys import register_keys, unregister_keys
from serve_app.backpressure import proxy_hold as proxy_flow
from serve_app.config.options import ServeConfig
from serve_app.config.public_bind import proxy_host, refuse_open_public_bind
from serve_app.errors.fault_injection import FaultInjectionMiddleware
from serve_app.generations.routes import GenerationsAPI
from serve_app.grammar.schema_limits import SchemaLimits, configure_schema_limits
from serve_app.metrics import record_outcome
from serve_app.openai.routes import OpenAIHandlers
from serve_app.openapi.public import openapi_route
from serve_app.ops.drain_gate import DrainGate
from serve_app.responses.routes import ResponsesAPI
from serve_app.served_by import ServedByMiddleware
from serve_app.server_info import server_info

logger = logging.getLogger(__name__)

# /health is green only when an engine replica answers within this.
HEALTH_ENGINE_TIMEOUT_S = 5.0


def metric_endpoint(route: Any) -> str:
    """`completions`, `generations`, `cancel`, ...: a route template's last literal part."""
    path = getattr(route, "path", None)
    if not path:
        return "unrouted"
    literal = [part for part in path.split("/") if part and not part.startswith("{")]
    return literal[-1] if literal else "unrouted"


class Ingress:
    def __init__(
        self,
        config: ServeConfig,
        tokenizer_handle: Any,
        grammar_handle: Any,
        engine_handle: Any,
        identity: dict[str, Any],
        admin_handle: Any = None,
        responses_handle: Any = None,
    ):
        # Under serve run / serve deploy the proxy's address is Serve's, not ServeConfig's.
        refuse_open_public_bind(config, proxy_host())
        ray_env.refuse_missing_direct_ingress(config.direct_ingress, config.port)
        self.config = config
        self.identity = identity
        self.created = int(time.time())
        # Request validators (no config of their own) bound schemas by this server's limits.
        grammar = config.grammar
        configure_schema_limits(SchemaLimits(grammar.max_schema_depth, grammar.max_schema_nodes))
        # Handles arrive with the options of the process that built the graph; the data
        # plane is this replica's (its node's `ray start` environment, serve_app/ray_env.py).
        by_reference = not ray_env.grpc_data_plane()
        tokenizer_handle = tokenizer_handle.options(_by_reference=by_reference)
        engine_handle = engine_handle.options(**ray_env.data_plane_options())
        # A compile's result goes to the engine as an object ref (the engine prefills while
        # it compiles): always by reference.
        grammar_handle = grammar_handle.options(_by_reference=True)
        self.openai = OpenAIHandlers(
            config, tokenizer_handle, grammar_handle, engine_handle, identity, self.admit
        )
        self.generations = GenerationsAPI(
            config, tokenizer_handle, grammar_handle, engine_handle, identity, self.admit
        )
        self.responses = ResponsesAPI(
            config,
            tokenizer_handle,
            grammar_handle,
            engine_handle,
            identity,
            self.admit,
            store=self.generations.store,
            runner=responses_handle,
        )
        self._engine = engine_handle
        # Serve's proxy answers /-/routes itself: it checks keys against what this registers.
        self._keys_owner = register_keys(config.api_keys)
        # Bound here so that Serve deploys the admin API with the app; it holds the flag.
        self._admin = admin_handle
        self._drain_gate = (
            DrainGate(lambda: admin_handle.is_draining.remote())
            if admin_handle is not None
            else None
        )
        # This replica's environment is the head raylet's, as the proxy's is.
        if not proxy_flow.is_enabled():
            logger.warning(proxy_flow.MISSING_HOOK_WARNING)
        if config.fault_injection:
            logger.warning("fault injection is on: X-Fault-Injection answers 500 (test builds)")

    def __del__(self) -> None:
        unregister_keys(getattr(self, "_keys_owner", None))

    async def admit(self) -> None:
        """Refuse new work while draining (on a reading of the flag at most 0.5 s old)."""
        if self._drain_gate is not None and await self._drain_gate.is_draining():
            raise errors.overloaded(
                "The server is draining: in-flight requests finish, new ones go elsewhere.",
                retry_after_s=5,
            )

    def __serve_build_asgi_app__(self) -> Starlette:
        def on_error(request: Request, error: errors.APIError, exc: BaseException) -> None:
            # The matched route's template, never the client's path (ids are no metric
            # label, and Ray's metrics refuse non-ASCII label values).
            endpoint = metric_endpoint(request.scope.get("route"))
            record_outcome(endpoint, "error", error.code)
            if error.status >= 500 and errors.api_error_in(exc) is None:
                logger.error("unhandled %s on %s", type(exc).__name__, endpoint)

        return Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/server_info", self.server_info, methods=["GET"]),
                openapi_route(self.config),
                Route("/v1/chat/completions", self.openai.chat, methods=["POST"]),
                Route("/v1/completions", self.openai.completions, methods=["POST"]),
                *self.generations.routes(),
                *self.responses.routes(),
            ],
            # Every failure, the router's 404 / 405 included, in the one error shape.
            exception_handlers=errors.exception_handlers(on_error),
            # Authentication and the body cap come before any route runs (and before an
            # injected fault, in a test build).
            middleware=[
                Middleware(ServedByMiddleware),
                access_middleware(self.config),
                *([Middleware(FaultInjectionMiddleware)] if self.config.fault_injection else []),
            ],
        )

    async def health(self, request: Request) -> Response:
        """Green only when an engine replica answers: while none is placed or all are being
        replaced, a load balancer must not send traffic here."""

        async def ping() -> None:
            await self._engine.stats.remote()

        try:
            await asyncio.wait_for(ping(), HEALTH_ENGINE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 (no replica, or one that failed)
            raise errors.overloaded(
                f"No engine replica is ready ({type(exc).__name__}).", retry_after_s=5
            ) from None
        return JSONResponse({"status": "ok", "model": self.config.model_id})

    async def models(self, request: Request) -> Response:
        # A key lists only the models it may use.
        if not principal_of(request).can_use_model(self.config.model_id):
            return JSONResponse({"object": "list", "data": []})
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.model_id,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "serve-app",
                        "max_model_len": self.identity["max_model_len"],
                        "fingerprint": self.identity["fingerprint"],
                    }
                ],
            }
        )

    async def server_info(self, request: Request) -> Response:
        return JSONResponse(server_info(self.config, self.identity))
