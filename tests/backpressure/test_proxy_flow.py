"""The pieces of proxy backpressure without Ray: the proxy middleware's stall detection and
header hygiene, the board's versions and leases, and the gate's pause/resume calls."""

from __future__ import annotations

import asyncio

import pytest

from serve_app import ray_env
from serve_app.backpressure import proxy_hold as proxy_flow
from serve_app.backpressure import stalled_streams as flow_board
from serve_app.backpressure.proxy_hold import FLOW_HEADER, ProxyHoldMiddleware, flow_header
from serve_app.backpressure.stalled_streams import StalledStreams, StallWatcher


class FakeBoard:
    """Stands in for the board actor: `handle.pause.remote(key)` is awaitable."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []

        def method(name):
            class M:
                @staticmethod
                def remote(key):
                    self.calls.append((name, key))
                    fut = asyncio.get_running_loop().create_future()
                    fut.set_result(None)
                    return fut

            return M

        self.pause, self.resume = method("pause"), method("resume")


def streaming_app(num_chunks: int, headers: list):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for i in range(num_chunks):
            await send({"type": "http.response.body", "body": b"x", "more_body": i < num_chunks})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def run_through(app, send_delays: list[float]) -> tuple[list[dict], FakeBoard]:
    """Run `app` behind the middleware; the client's socket takes body write i after
    `send_delays[i]` seconds (0 when the list runs out)."""
    board = FakeBoard()
    sent: list[dict] = []

    async def send(message):
        if message["type"] == "http.response.body":
            i = sum(m["type"] == "http.response.body" for m in sent)
            await asyncio.sleep(send_delays[i] if i < len(send_delays) else 0)
        sent.append(message)

    async def main():
        middleware = ProxyHoldMiddleware(app)
        await middleware({"type": "http"}, None, send)
        await asyncio.gather(*middleware._calls)

    original = proxy_flow._lookup_board
    proxy_flow._lookup_board = lambda name: board
    try:
        asyncio.run(main())
    finally:
        proxy_flow._lookup_board = original
    return sent, board


def test_a_stuck_write_pauses_its_flow_and_the_write_going_through_resumes_it():
    name, value = flow_header("flow:my model", "k1")
    app = streaming_app(
        4, [(b"content-type", b"text/event-stream"), (name.encode(), value.encode())]
    )
    sent, board = run_through(app, [0, 0, proxy_flow.STALL_S + 0.3, 0])
    assert board.calls == [("pause", "k1"), ("resume", "k1")]
    # The internal header never reaches the client; the others do.
    headers = dict(sent[0]["headers"])
    assert FLOW_HEADER.encode() not in headers and headers[b"content-type"] == b"text/event-stream"
    assert len(sent) == 6


def test_a_long_stall_keeps_renewing_its_pause():
    name, value = flow_header("flow:m", "k2")
    app = streaming_app(1, [(name.encode(), value.encode())])
    _, board = run_through(app, [proxy_flow.STALL_S + 2.2 * proxy_flow.HEARTBEAT_S])
    assert board.calls == [("pause", "k2")] * 3 + [("resume", "k2")]


def test_uvicorns_transport_gets_capped_buffers_and_a_refusing_socket_is_tolerated():
    class Sock:
        def __init__(self, fails):
            self.fails, self.options = fails, []

        def setsockopt(self, *option):
            if self.fails:
                raise OSError("not supported")
            self.options.append(option)

    class Transport:
        def __init__(self, sock):
            self.sock, self.limits = sock, None

        def get_extra_info(self, name):
            return self.sock if name == "socket" else None

        def set_write_buffer_limits(self, high, low):
            self.limits = (high, low)

    class Cycle:
        """uvicorn's request cycle: `send` is bound to it, and it holds the transport."""

        def __init__(self, transport):
            self.transport = transport

        async def send(self, message):
            pass

    high = proxy_flow.WRITE_HIGH_WATER_BYTES
    for fails in (False, True):
        transport = Transport(Sock(fails))
        proxy_flow._bound_buffers(Cycle(transport).send)
        assert transport.limits == (high, high // 2)
        assert len(transport.sock.options) == (0 if fails else 1)


def test_on_uvicorn_a_write_after_the_transport_paused_is_the_one_that_stalls_and_pauses():
    """uvicorn waits only before a write, and only while its transport is paused: the writes
    before the pause go straight through, the one that waits on the drain pauses the key."""

    class Flow:
        def __init__(self):
            self.write_paused = False
            self.drained = asyncio.Event()

    class Transport:
        def get_extra_info(self, name):
            return None

        def set_write_buffer_limits(self, high, low):
            pass

    class Cycle:
        def __init__(self):
            self.flow, self.transport, self.bodies = Flow(), Transport(), 0

        async def send(self, message):
            if self.flow.write_paused:
                await self.flow.drained.wait()
                self.flow.write_paused = False
            if message["type"] == "http.response.body":
                self.bodies += 1
                # The client stopped reading: this write filled the buffer past high water.
                self.flow.write_paused = self.bodies == 2

    board = FakeBoard()
    name, value = flow_header("flow:m", "k3")
    app = streaming_app(4, [(name.encode(), value.encode())])

    async def main():
        cycle = Cycle()
        middleware = ProxyHoldMiddleware(app)
        loop = asyncio.get_running_loop()
        loop.call_later(proxy_flow.STALL_S + 0.3, cycle.flow.drained.set)
        await middleware({"type": "http"}, None, cycle.send)
        await asyncio.gather(*middleware._calls)
        return cycle

    original = proxy_flow._lookup_board
    proxy_flow._lookup_board = lambda name: board
    try:
        cycle = asyncio.run(main())
    finally:
        proxy_flow._lookup_board = original
    assert cycle.bodies == 5
    assert board.calls == [("pause", "k3"), ("resume", "k3")]


def test_responses_without_a_flow_key_are_passed_through_untouched():
    sent, board = run_through(streaming_app(2, [(b"a", b"b")]), [proxy_flow.STALL_S + 0.2])
    assert board.calls == [] and sent[0]["headers"] == [(b"a", b"b")]


def test_the_board_wakes_watchers_on_change_and_expires_unrenewed_leases():
    async def main():
        board = StalledStreams(lease_s=0.3)
        version, keys = await board.watch(-1, 1.0)
        assert keys == []
        watcher = asyncio.create_task(board.watch(version, 5.0))
        await asyncio.sleep(0.05)
        await board.pause("a")
        version, keys = await asyncio.wait_for(watcher, 1.0)
        assert keys == ["a"]
        await board.resume("a")
        await board.pause("b")
        # Nobody renews "b": its lease ends, and a watch returns without it.
        version, keys = await board.watch(version, 0.1)
        assert keys == ["b"]
        await asyncio.sleep(0.35)
        _, keys = await board.watch(version, 0.1)
        assert keys == []

    asyncio.run(main())


def test_the_gate_pauses_and_resumes_only_the_requests_of_a_key():
    calls: list[tuple[str, bool]] = []
    gate = StallWatcher("app", lambda rid, paused: calls.append((rid, paused)))
    gate._requests = {"k": {"r1"}, "other": {"r2"}}
    gate.apply({"k"})
    gate.apply({"k"})
    gate.apply(set())
    assert calls == [("r1", True), ("r1", False)]


def test_a_request_tracked_under_an_already_paused_key_is_paused_at_once(monkeypatch):
    calls: list[tuple[str, bool]] = []

    async def main():
        gate = StallWatcher("app", lambda rid, paused: calls.append((rid, paused)))
        monkeypatch.setattr(gate, "_watch", lambda: asyncio.sleep(0))
        gate._paused = {"k"}
        gate.track("k", "r1")
        gate.untrack("k", "r1")
        assert gate._requests == {}
        gate.stop()

    asyncio.run(main())
    assert calls == [("r1", True)]


@pytest.mark.parametrize("value", ["", "other.module:callback"])
def test_an_operators_own_proxy_callback_is_kept_and_flow_is_then_off(monkeypatch, value):
    monkeypatch.setenv(proxy_flow.CALLBACK_ENV, value)
    ray_env.prepare()  # what a local Ray's environment gets: the operator's value stays
    assert proxy_flow.is_enabled() is False
    assert flow_board.board_name("m") == "flow:m"
