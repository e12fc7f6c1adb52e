"""The streamed response keeps Starlette's contract under an ASGI 2.3 server (uvicorn, as Serve
runs it): the whole body when the client stays, the body cancelled and cleaned up before the
response ends when the client leaves, the body's error raised, the background run after."""

from __future__ import annotations

import asyncio

import pytest
from starlette.background import BackgroundTask

from serve_app.protocol.event_stream import EventStreamResponse

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}


class Client:
    """An ASGI receive/send pair: sent messages are kept; `leave()` makes receive answer
    http.disconnect."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self._left = asyncio.Event()
        self.receives = 0

    def leave(self) -> None:
        self._left.set()

    async def receive(self) -> dict:
        self.receives += 1
        await self._left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_a_client_that_stays_gets_the_whole_body_and_the_background_runs() -> None:
    ran = []

    async def body():
        for i in range(3):
            await asyncio.sleep(0)
            yield f"data: {i}\n\n".encode()

    async def main():
        client = Client()
        response = EventStreamResponse(body(), background=BackgroundTask(ran.append, "after"))
        await response(SCOPE, client.receive, client.send)
        return client

    client = run(main())
    assert client.body() == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert client.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert ran == ["after"]


def test_a_client_that_leaves_cancels_the_body_and_its_cleanup_runs_before_the_end() -> None:
    events = []

    async def body():
        try:
            yield b"data: first\n\n"
            await asyncio.Event().wait()  # the next token never comes
            yield b"data: never\n\n"
        finally:
            events.append("body closed")  # where the engine request is aborted

    async def main():
        client = Client()
        response = EventStreamResponse(body())
        call = asyncio.create_task(response(SCOPE, client.receive, client.send))
        while b"first" not in client.body():
            await asyncio.sleep(0)
        client.leave()
        await call  # ends normally: the client is gone, nothing to answer
        events.append("response ended")
        return client

    client = run(main())
    assert events == ["body closed", "response ended"]
    assert b"never" not in client.body()


def test_an_error_in_the_body_propagates_and_stops_the_watch() -> None:
    async def body():
        yield b"data: first\n\n"
        raise RuntimeError("the engine failed")

    async def main():
        client = Client()
        with pytest.raises(RuntimeError, match="the engine failed"):
            await EventStreamResponse(body())(SCOPE, client.receive, client.send)
        await asyncio.sleep(0)
        return client

    client = run(main())
    assert client.receives == 1


def test_a_cancelled_request_cleans_its_body_up_before_the_cancel_propagates() -> None:
    events = []

    async def body():
        try:
            yield b"data: first\n\n"
            await asyncio.Event().wait()
        finally:
            events.append("body closed")

    async def main():
        client = Client()
        call = asyncio.create_task(EventStreamResponse(body())(SCOPE, client.receive, client.send))
        while not client.body():
            await asyncio.sleep(0)
        call.cancel()  # Serve cancels a request whose caller left
        with pytest.raises(asyncio.CancelledError):
            await call
        events.append("cancel seen")

    run(main())
    assert events == ["body closed", "cancel seen"]


def test_a_server_of_spec_2_4_is_not_watched() -> None:
    async def body():
        yield b"data: x\n\n"

    async def main():
        client = Client()
        scope = {**SCOPE, "asgi": {"version": "3.0", "spec_version": "2.4"}}
        await EventStreamResponse(body())(scope, client.receive, client.send)
        return client

    client = run(main())
    assert client.body() == b"data: x\n\n" and client.receives == 0
