"""Are the ports a local start needs free? Asked before Ray starts, so a taken port is one
line and exit 2 instead of a Ray traceback after the proxy fails to bind, seconds later."""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass


class PortInUse(Exception):
    """A port the server would listen on is taken (or named twice); the message is the whole
    story, one line."""


REASONS = {
    errno.EADDRINUSE: "is in use",
    errno.EACCES: "needs privileges this user lacks",
    errno.EADDRNOTAVAIL: "cannot be bound: the host is not an address of this machine",
}


@dataclass(frozen=True)
class Listener:
    host: str
    port: int
    source: str  # where the operator set it: "--port", "port in serve.yaml", ...


def bind_problem(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port now, or None. Binds the way uvicorn
    (Serve's proxy) does, with SO_REUSEADDR, so a port left in TIME_WAIT by a stopped server
    counts as free."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror:
        return f"cannot be bound: the host {host!r} does not resolve"
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            return REASONS.get(exc.errno, exc.strerror or str(exc))
    return None


def check_free(listeners: list[Listener]) -> None:
    """Raise `PortInUse` for the first listener that cannot bind. Port 0 (any free port) is
    never checked."""
    seen: dict[int, Listener] = {}
    for listener in listeners:
        if listener.port == 0:
            continue
        first = seen.setdefault(listener.port, listener)
        if first is not listener:
            raise PortInUse(
                f"port {listener.port} is named twice ({first.source} and {listener.source})"
            )
        problem = bind_problem(listener.host, listener.port)
        if problem is not None:
            raise PortInUse(f"port {listener.port} {problem} ({listener.source})")
