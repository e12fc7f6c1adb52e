"""API keys at Serve's HTTP proxy: its own `/-/routes` (the route table of every app) needs a
key as soon as one keyed app runs behind the proxy.

The proxy answers `/-/routes` and `/-/healthz` itself, before any app sees the request, so
the ingress's admission middleware never runs for them. `RoutesGuard` runs inside the proxy
(installed with the flow middleware through Serve's proxy callback hook, `proxy_flow`) and
checks the Bearer key of a `/-/routes` request against `KeyDirectory`: a named actor that
every keyed ingress replica fills with its keys' SHA-256 hashes (never the keys) when it
starts. `/-/healthz` stays open for load balancers; it answers "success" and nothing more.

The directory is detached, so a keyed server never falls back to open when the replica that
created it goes; a replica that stops takes its entry out. Where the hook is not installed
(an operator's own proxy settings), `/-/routes` is open: block it in front of the proxy.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterable
from typing import Any

from serve_app import errors
from serve_app.access.keys import KeysFile, bearer_token, hash_key
from serve_app.named_actors import get_or_create

logger = logging.getLogger(__name__)

DIRECTORY_NAME = "proxy-keys"
DIRECTORY_NAMESPACE = "serve-app"
ROUTES_PATH = "/-/routes"


class KeyDirectory:
    """Key hashes by the ingress replica that registered them."""

    def __init__(self) -> None:
        self._hashes: dict[str, frozenset[str]] = {}

    def register(self, owner: str, hashes: list[str]) -> None:
        self._hashes[owner] = frozenset(hashes)

    def unregister(self, owner: str) -> None:
        self._hashes.pop(owner, None)

    def admits(self, key_hash: str | None) -> bool:
        """Open while no keyed app is registered; otherwise any registered key."""
        if not self._hashes:
            return True
        return key_hash is not None and any(key_hash in h for h in self._hashes.values())


def _directory() -> Any:
    # NOTE: not restarted when it dies: a restarted, empty directory would open the routes;
    # a dead one keeps them closed until a keyed replica starts and creates it again.
    return get_or_create(KeyDirectory, DIRECTORY_NAME, DIRECTORY_NAMESPACE, lifetime="detached")


def register_keys(keys: KeysFile | None) -> str | None:
    """Called by a keyed ingress replica as it starts (returns once the proxy would see the
    keys); the owner id to unregister with, or None for an app without keys."""
    if keys is None:
        return None
    import ray

    owner = uuid.uuid4().hex
    ray.get(_directory().register.remote(owner, [entry.sha256 for entry in keys.keys]))
    return owner


def unregister_keys(owner: str | None) -> None:
    """Best effort, at replica shutdown: a stale entry only keeps `/-/routes` closed."""
    if owner is None:
        return
    try:
        _directory().unregister.remote(owner)
    except Exception as exc:  # noqa: BLE001 (Ray already shutting down)
        logger.debug("key directory not reached: %s", type(exc).__name__)


def _lookup_directory() -> Any | None:
    import ray

    try:
        return ray.get_actor(DIRECTORY_NAME, namespace=DIRECTORY_NAMESPACE)
    except ValueError:  # never created: no keyed app has run on this cluster
        return None


class RoutesGuard:
    """Proxy middleware: `/-/routes` only with a key when the directory holds keys."""

    def __init__(self, app: Any):
        self.app = app
        self._directory: Any = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") != ROUTES_PATH:
            await self.app(scope, receive, send)
            return
        token = bearer_token(_header(scope, b"authorization"))
        key_hash = hash_key(token) if token is not None else None
        if await self._admits(key_hash):
            await self.app(scope, receive, send)
            return
        message = "Invalid API key." if token else "Missing API key: send 'Bearer <key>'."
        await errors.invalid_api_key(message).response()(scope, receive, send)

    async def _admits(self, key_hash: str | None) -> bool:
        try:
            if self._directory is None:
                self._directory = await asyncio.to_thread(_lookup_directory)
                if self._directory is None:
                    return True
            return bool(await self._directory.admits.remote(key_hash))
        except Exception as exc:  # noqa: BLE001 (closed while the directory is unreachable)
            logger.warning("key directory unreachable: %s", type(exc).__name__)
            self._directory = None
            return False


def _header(scope: dict, name: bytes) -> str | None:
    headers: Iterable[tuple[bytes, bytes]] = scope.get("headers") or ()
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None
