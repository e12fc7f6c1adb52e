"""Ingress deployment: routes only. Each route hands off to its API family's handlers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serve_app import errors, ray_env
from serve_app.admin import find_registry
from serve_app.auth import principal_of
from serve_app.auth_middleware import admission_middleware
from serve_app.config import ServeConfig
from serve_app.generations_api import GenerationsAPI
from serve_app.metrics import record_outcome
from serve_app.openai_api import OpenAIHandlers
from serve_app.server_info import server_info

DRAIN_CHECK_PERIOD_S = 0.5
# /health is green only when an engine replica answers within this.
HEALTH_ENGINE_TIMEOUT_S = 5.0


class Ingress:
    def __init__(
        self,
        config: ServeConfig,
        tokenizer_handle: Any,
        grammar_handle: Any,
        engine_handle: Any,
        identity: dict[str, Any],
    ):
        self.config = config
        self.identity = identity
        self.created = int(time.time())
        # Handles arrive with the options of the process that built the graph; the data
        # plane is this replica's (its node's `ray start` environment, serve_app/ray_env.py).
        by_reference = not ray_env.grpc_data_plane()
        tokenizer_handle = tokenizer_handle.options(_by_reference=by_reference)
        engine_handle = engine_handle.options(_by_reference=by_reference)
        # A compile's result goes to the engine as an object ref (the engine prefills while
        # it compiles): always by reference.
        grammar_handle = grammar_handle.options(_by_reference=True)
        self.openai = OpenAIHandlers(
            config, tokenizer_handle, grammar_handle, engine_handle, identity, self.admit
        )
        self.generations = GenerationsAPI(
            config, tokenizer_handle, grammar_handle, engine_handle, identity, self.admit
        )
        self._engine = engine_handle
        self._registry = None
        self._drain_checked_at = 0.0
        self._draining = False

    async def admit(self) -> None:
        """Refuse new work while draining (the flag is read at most twice a second)."""
        now = time.monotonic()
        if now - self._drain_checked_at > DRAIN_CHECK_PERIOD_S:
            self._drain_checked_at = now
            if self._registry is None:
                self._registry = find_registry(self.config.model_id)
            if self._registry is not None:
                self._draining = await self._registry.is_draining.remote()
        if self._draining:
            raise errors.overloaded(
                "The server is draining: in-flight requests finish, new ones go elsewhere.",
                retry_after_s=5,
            )

    def __serve_build_asgi_app__(self) -> Starlette:
        async def on_api_error(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, errors.APIError)
            endpoint = request.url.path.rsplit("/", 1)[-1]
            record_outcome(endpoint, "error", exc.code)
            return exc.response()

        return Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/server_info", self.server_info, methods=["GET"]),
                Route("/v1/chat/completions", self.openai.chat, methods=["POST"]),
                Route("/v1/completions", self.openai.completions, methods=["POST"]),
                *self.generations.routes(),
            ],
            exception_handlers={errors.APIError: on_api_error},
            # Authentication and the body cap come before any route runs.
            middleware=[admission_middleware(self.config)],
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
