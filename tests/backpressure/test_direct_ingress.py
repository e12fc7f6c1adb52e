"""`direct_ingress: true`: the ingress replica owns the client's socket (Serve's direct
ingress), and what Serve's proxy gave the path still holds there: a streamed chat keeps its
event order, `/-/routes` needs a key, and a client that stops reading is held, then resumes
with its whole stream. A server of its own (`serve-app serve`, its own Ray): Serve reads the
setting once, when its processes start."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time

import httpx
import psutil
import pytest
import yaml

from serve_app.access.keys import hash_key
from serve_app.ports import LINGERING, bind_problem, listening
from tests.backpressure.test_proxy_backpressure import (
    HELD_WITHIN_S,
    _dechunk,
    sse_events,
    text_and_finish,
    wait_for,
)
from tests.server.test_serve_start_stop import serve_env, short_ray_dir, start_serve
from tests.support.ports import free_port

pytestmark = [pytest.mark.serve, pytest.mark.timeout(900)]

MODEL = "flow-tiny"
KEY = "key-direct"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG_TOKENS = 900
STEP_DELAY_S = 0.004


class DirectServer:
    def __init__(self, proc: subprocess.Popen, port: int, admin_port: int) -> None:
        self.proc = proc
        self.url = f"http://127.0.0.1:{port}"
        self.admin = f"http://127.0.0.1:{admin_port}"
        self.port = port
        self.admin_port = admin_port


@pytest.fixture(scope="module")
def direct(model_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("direct")
    keys = tmp / "keys.yaml"
    keys.write_text(
        yaml.safe_dump(
            {"keys": [{"id": "k", "sha256": hash_key(KEY), "tenant": "t", "admin": True}]}
        )
    )
    # Below the ephemeral range: the replica binds without SO_REUSEADDR (ports.py).
    port, admin_port = free_port(), free_port()
    config = {
        "model": str(model_dirs("llama")),
        "served_model_name": MODEL,
        "port": port,
        "admin_port": admin_port,
        "direct_ingress": True,
        "api_keys_file": str(keys),
        # A slow model, not a slow machine: a fast CPU streamed all 900 tokens into the
        # socket buffers before the write blocked, and nothing was ever held.
        "engine": {"block_size": 16, "hold_timeout_s": 8.0, "step_delay_s": STEP_DELAY_S},
        "generations": {"data_dir": str(tmp / "data")},
    }
    (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    with short_ray_dir() as ray_dir:
        proc, out, err = start_serve(["--config", str(tmp / "config.yaml")], serve_env(ray_dir))
        try:
            out.wait_for("ready", proc, err, timeout_s=600)
            yield DirectServer(proc, port, admin_port)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def stats(admin_url: str) -> dict:
    return httpx.get(f"{admin_url}/admin/v1/stats", headers=AUTH, timeout=10).json()["total"]


def is_idle(admin_url: str) -> bool:
    s = stats(admin_url)
    return s["live_requests"] == 0 and s["kv_blocks_used"] == 0


def listener_of(port: int) -> str:
    """The command line of the process that listens on `port`."""
    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return " ".join(psutil.Process(conn.pid).cmdline())
    raise AssertionError(f"nothing listens on {port}")


def sockets_on(port: int) -> list[str]:
    """Every TCP socket on `port`, with its state and process, for a failure message."""
    found = []
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port:
            owner = psutil.Process(conn.pid).name() if conn.pid else "no process"
            found.append(f"{conn.status} {conn.laddr} -> {conn.raddr or '-'} ({owner})")
    return found


def test_the_ingress_replica_listens_on_the_port_and_streams_a_chat_in_order(direct):
    assert listener_of(direct.port).startswith("ray::ServeReplica:serve-app:ingress")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something"}],
        "max_tokens": 24,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", f"{direct.url}/v1/chat/completions", json=body, headers=AUTH, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"]
        events = sse_events(r.read())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    finishes = [
        i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["finish_reason"]
    ]
    assert len(finishes) == 1 and chunks[finishes[0]]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 24
    assert finishes[0] == len(chunks) - 2
    assert all(c["choices"] and "content" in c["choices"][0]["delta"] for c in chunks[1:-2])
    assert len({c["id"] for c in chunks}) == 1


def test_unauthenticated_requests_and_the_route_table_are_refused(direct):
    r = httpx.post(f"{direct.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 401
    assert httpx.get(f"{direct.url}/-/routes").status_code == 401
    r = httpx.get(f"{direct.url}/-/routes", headers=AUTH)
    assert r.status_code == 200 and r.json() == {"/": "serve-app"}
    assert httpx.get(f"{direct.url}/-/healthz").status_code == 200


def completion(max_tokens: int) -> dict:
    return {
        "model": MODEL,
        "prompt": "Tell me a long story",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
    }


def streamed(url: str, max_tokens: int) -> list[str]:
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=completion(max_tokens), headers=AUTH, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        return sse_events(r.read())


def stalled_request(url: str, payload: dict) -> tuple[socket.socket, bytes]:
    """A streamed request that reads the response head and then nothing (a small receive
    buffer): the socket and what came after the head."""
    host, port = httpx.URL(url).host, httpx.URL(url).port
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, port))
    data = json.dumps(payload).encode()
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += sock.recv(1024)
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.decode("latin-1").lower().startswith("http/1.1 200")
    return sock, rest


def read_to_end(sock: socket.socket, raw: bytes) -> list[str]:
    sock.settimeout(60)
    while not raw.endswith(b"0\r\n\r\n"):
        more = sock.recv(65536)
        assert more, "connection closed before the end of the stream"
        raw += more
    sock.close()
    return sse_events(_dechunk(raw))


def test_a_client_that_stops_reading_is_held_then_resumes_with_its_whole_stream(direct):
    reference, finish, _ = text_and_finish(streamed(direct.url, LONG_TOKENS))
    assert finish == "length"

    sock, rest = stalled_request(direct.url, completion(LONG_TOKENS))
    wait_for(lambda: stats(direct.admin)["held"] == 1, HELD_WITHIN_S)
    time.sleep(0.5)  # the step in flight when the hold landed
    at_hold = stats(direct.admin)
    assert text_and_finish(streamed(direct.url, 60))[1] == "length"  # others stream on
    wait_for(lambda: stats(direct.admin)["live_requests"] == 1, 5)
    after = stats(direct.admin)
    assert after["held"] == 1 and after["kv_blocks_used"] == at_hold["kv_blocks_used"]

    text, finish, _ = text_and_finish(read_to_end(sock, rest))
    assert (text, finish) == (reference, "length")
    wait_for(lambda: is_idle(direct.admin), 5)


def test_ctrl_c_stops_the_server_and_frees_its_ports(direct):
    """Nothing listens on either port once it says stopped. Connections the server closed
    first may hold a port in TIME_WAIT for a minute (Serve's direct-ingress replica binds
    without SO_REUSEADDR); a restart waits for those (tests/server/test_serve_start_stop.py)."""
    direct.proc.send_signal(signal.SIGINT)
    assert direct.proc.wait(timeout=120) == 0
    for port in (direct.port, direct.admin_port):
        assert listening(port) is False, sockets_on(port)
        assert bind_problem("127.0.0.1", port, reuse_addr=False) in (None, LINGERING)
