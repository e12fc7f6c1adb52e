"""Are the ports a local start needs free? Asked before Ray starts, so a taken port is one
line and exit 2 instead of a Ray traceback after the proxy fails to bind, seconds later.

"In use" means another program listens there. A port that only the closed connections of a
stopped server still hold (TCP TIME_WAIT, at most a minute on Linux) is "lingering": a start
waits for it, saying so, instead of refusing. It matters under direct ingress, where Serve's
replica binds without SO_REUSEADDR, so every connection that server closed first blocks the
port for that minute."""

from __future__ import annotations

import errno
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class PortInUse(Exception):
    """A port the server would listen on is taken (or named twice); the message is the whole
    story, one line."""


REASONS = {
    errno.EADDRINUSE: "is in use",
    errno.EACCES: "needs privileges this user lacks",
    errno.EADDRNOTAVAIL: "cannot be bound: the host is not an address of this machine",
}
LINGERING = "is held by the closed connections of a stopped server (TCP TIME_WAIT)"
# Linux keeps a TIME_WAIT socket 60 s; a start waits a little longer than that.
LINGER_WAIT_S = 65.0
TCP_LISTEN = "0A"  # the state column of /proc/net/tcp


@dataclass(frozen=True)
class Listener:
    host: str
    port: int
    source: str  # where the operator set it: "--port", "port in serve.yaml", ...
    # Whether the server binds it with SO_REUSEADDR: Serve's proxy does, a direct-ingress
    # replica does not (and then a TIME_WAIT connection blocks the bind).
    reuse_addr: bool = True


def bind_problem(host: str, port: int, reuse_addr: bool = True) -> str | None:
    """Why a server could not listen on host:port now, or None. Binds the way the server
    will (`reuse_addr`: SO_REUSEADDR, as Serve's proxy binds); a port nothing listens on
    that still cannot be bound is `LINGERING`."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror:
        return f"cannot be bound: the host {host!r} does not resolve"
    with socket.socket(family, socket.SOCK_STREAM) as s:
        if reuse_addr:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE and listening(port) is False:
                return LINGERING
            return REASONS.get(exc.errno, exc.strerror or str(exc))
    return None


def listening(port: int) -> bool | None:
    """Whether any TCP socket of this machine listens on `port`, from /proc/net/tcp{,6};
    None where those tables cannot be read (not Linux)."""
    tables = 0
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        tables += 1
        for row in rows:
            fields = row.split()  # sl local_address rem_address st ...
            if fields[3] == TCP_LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False if tables else None


def check_free(
    listeners: list[Listener],
    linger_wait_s: float = LINGER_WAIT_S,
    say: Callable[[str], None] = print,
) -> None:
    """Raise `PortInUse` for the first listener that cannot bind. A lingering port is waited
    for (up to `linger_wait_s`, said once through `say`). Port 0 (any free port) is never
    checked."""
    seen: dict[int, Listener] = {}
    for listener in listeners:
        if listener.port == 0:
            continue
        first = seen.setdefault(listener.port, listener)
        if first is not listener:
            raise PortInUse(
                f"port {listener.port} is named twice ({first.source} and {listener.source})"
            )
        problem = bind_problem(listener.host, listener.port, listener.reuse_addr)
        if problem == LINGERING:
            problem = _wait_lingering(listener, linger_wait_s, say)
        if problem is not None:
            raise PortInUse(f"port {listener.port} {problem} ({listener.source})")


def _wait_lingering(listener: Listener, timeout_s: float, say: Callable[[str], None]) -> str | None:
    say(f"port {listener.port} {LINGERING}: waiting for it (at most {timeout_s:.0f} s)")
    deadline = time.monotonic() + timeout_s
    while (problem := bind_problem(listener.host, listener.port, listener.reuse_addr)) == LINGERING:
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return problem
