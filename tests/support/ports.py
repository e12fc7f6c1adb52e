"""Free loopback ports for the servers the tests start."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range, for a server a test starts.
    A port from the ephemeral range (what binding port 0 gives) can be taken, between the
    pick and the server's bind or after a replaced server released it, as the local port of
    one of Ray's own outgoing connections; the bind then fails (a redeployed admin replica
    found its port taken for over 30 s)."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default
