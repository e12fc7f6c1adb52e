"""The slow-consumer case's stalled client reads at full speed once it reads again.

Its small receive buffer must be set before it connects (tcp(7)): the window scale is agreed
in the handshake, so a buffer shrunk afterwards cannot hold the window the client already
advertised, the sender's segments past it are dropped, and retransmission backs off
exponentially while the client stalls. After a 35 s stall the first byte then came 18 s after
the client read again, and on the trained model our server's hold deadline (30 s) ended the
held request as `slow_consumer` while its client was reading."""

from __future__ import annotations

import socket
import threading
import time

import httpx

from serve_app.conformance.cases.lifecycle import StalledClient

EVENTS = 800  # ~230 KB of SSE: several times what the sockets between the two hold
STALL_S = 3.0
# Read whole at loopback speed; with the buffer shrunk after connect it took ~6 s.
READ_WITHIN_S = 2.0


def serve_one_stream(listener: socket.socket) -> None:
    conn, _ = listener.accept()
    with conn:
        # As Serve's proxy does with a flow-keyed response (serve_app/backpressure).
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 * 1024)
        raw = b""
        while b"\r\n\r\n" not in raw:
            raw += conn.recv(4096)
        head, _, body = raw.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(body) < length:
            body += conn.recv(4096)
        conn.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for i in range(EVENTS):
            event = f'data: {{"i": {i}, "text": "{"x" * 240}"}}\n\n'.encode()
            conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
        done = b"data: [DONE]\n\n"
        conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


def test_a_stalled_client_reads_at_full_speed_once_it_reads_again():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = threading.Thread(target=serve_one_stream, args=(listener,), daemon=True)
    server.start()
    try:
        client = StalledClient(f"http://127.0.0.1:{port}", "/v1/completions", {}, httpx.Headers())
        try:
            assert client.head.startswith("http/1.1 200")
            time.sleep(STALL_S)
            started = time.monotonic()
            events = client.read_to_end()
            took = time.monotonic() - started
        finally:
            client.close()
        assert len(events) == EVENTS + 1 and events[-1] == "[DONE]"
        assert took < READ_WITHIN_S, f"read to the end in {took:.1f} s"
    finally:
        listener.close()
        server.join(timeout=10)
