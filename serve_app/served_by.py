"""`x-served-by`: every public answer names the ingress replica that made it, so a client
(or a test) can tell replicas apart; state that must outlive a replica lives in the store."""

from __future__ import annotations

import os
import socket
from typing import Any

HEADER = b"x-served-by"


def replica_name() -> str:
    """This Serve replica's id; outside Serve, the host and process."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 (not in a Serve replica: a local app or a test)
        return f"{socket.gethostname()}:{os.getpid()}"


class ServedByMiddleware:
    """Adds the header to every HTTP answer, streamed ones and errors included."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.name: bytes | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.name is None:
            self.name = replica_name().encode()

        async def send_named(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (HEADER, self.name)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_named)
