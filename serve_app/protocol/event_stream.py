"""The HTTP response every streamed endpoint answers with (server-sent events and the like).

Starlette's `StreamingResponse` under an ASGI server older than spec 2.4 (uvicorn says 2.3,
Serve's proxy and its direct ingress run uvicorn) streams in one task and waits for the
client's disconnect in another, inside an anyio task group, and cancels the group's scope
when either ends: 107 µs of CPU per response, most of it anyio's cancel machinery (its
cancel reason formats the task's repr, down to its callbacks' source lines). The same two
tasks in plain asyncio cost 26 µs (`benchmarks/event_stream.py`). The contract is
Starlette's: the body streams until it ends or the client disconnects, whichever comes
first; a disconnect cancels the body's task (its generators' `finally` blocks abort the
engine request) and the response ends once that cancel has run; an error in the body
propagates.
"""

from __future__ import annotations

import asyncio

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class EventStreamResponse(StreamingResponse):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        spec = scope.get("asgi", {}).get("spec_version", "2.0")
        if tuple(map(int, spec.split("."))) >= (2, 4):
            # The server raises on a send after a disconnect: no watcher needed.
            await super().__call__(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        streaming = loop.create_task(self.stream_response(send))
        listening = loop.create_task(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait((streaming, listening), return_when=asyncio.FIRST_COMPLETED)
        finally:
            listening.cancel()
            if not streaming.done():
                # The client left (or this request was cancelled): the body's cleanup runs
                # before the response ends, as under Starlette's task group.
                streaming.cancel()
                await asyncio.wait((streaming,))
        for task in (listening, streaming):
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        if self.background is not None:
            await self.background()
