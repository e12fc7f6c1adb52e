"""Fault injection for test builds (`fault_injection: true` in the config): a request that
carries `X-Fault-Injection: internal_error` fails inside the server once it is authenticated,
so a black-box client (the conformance suite) can see the 500 class: the error shape, `code`
`internal_error` and `x-should-retry: false`. Off by default; `/v1/server_info` says when on."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

HEADER = "x-fault-injection"
FAULTS = ("internal_error",)

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


class InjectedFault(RuntimeError):
    """The failure a fault-injection header asked for: an exception no route handles, as a bug
    would raise, so the answer is the server's own catch-all 500."""


class FaultInjectionMiddleware:
    """Raises `InjectedFault` for a request that asks for one. It sits inside the access
    middleware: an unauthenticated caller gets its 401, never the fault."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            fault = requested_fault(scope)
            if fault is not None:
                raise InjectedFault(f"fault injection: {fault}")
        await self.app(scope, receive, send)


def requested_fault(scope: Scope) -> str | None:
    for name, value in scope.get("headers") or ():
        if name.decode("latin-1").lower() == HEADER:
            fault = value.decode("latin-1").strip().lower()
            return fault if fault in FAULTS else None
    return None


def fault_injection_info(enabled: bool) -> dict[str, Any]:
    """What `/v1/server_info` publishes: whether the setting is on and how to ask for a fault."""
    if not enabled:
        return {"enabled": False}
    return {"enabled": True, "header": "X-Fault-Injection", "faults": list(FAULTS)}
