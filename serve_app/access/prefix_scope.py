"""The prefix-cache scope of a request: the namespace its KV blocks are cached under.

Cached blocks are keyed by the authenticated tenant, so one tenant can neither reuse nor time
another's cached prefix. The server derives the namespace from the principal; no request field
can name it (a client-chosen salt, as vLLM's `cache_salt`, lets any caller claim another
tenant's: CVE-2025-46570). The operator may pool tenants into one shared namespace with
`engine.shared_prefix_tenants`; nothing per request can.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

# The pooled tenants' namespace. Tenant namespaces all start with "tenant:", so no tenant
# name, however chosen, can spell this one.
SHARED_NAMESPACE = "shared"
_TENANT_PREFIX = "tenant:"

RULE = (
    "cached prompt blocks are keyed by the authenticated tenant (from the API key; a server "
    "without API keys is one tenant): a request only reuses prefixes its own tenant computed, "
    "so cached_tokens and time to first token reveal nothing about other tenants' prompts. "
    "No request field sets the cache key; tenants pool one shared cache only when the "
    "operator lists them in engine.shared_prefix_tenants"
)


def prefix_namespace(tenant: str, shared_tenants: Collection[str]) -> str:
    """The engine's cache namespace for a request of `tenant`."""
    if tenant in shared_tenants:
        return SHARED_NAMESPACE
    return _TENANT_PREFIX + tenant


def check_shared_tenants(shared_tenants: Collection[str], known_tenants: Collection[str]) -> None:
    """A name that matches no tenant would share nothing, silently: refuse it at startup."""
    unknown = sorted(set(shared_tenants) - set(known_tenants))
    if unknown:
        raise ValueError(
            f"engine.shared_prefix_tenants: {unknown[0]!r} is not a tenant of any API key "
            f"(tenants: {', '.join(sorted(known_tenants))})"
        )


def prefix_cache_info(enabled: bool, shared_tenants: Collection[str]) -> dict[str, Any]:
    """The rule for /v1/server_info. Counts, not names: every key can read server_info, and
    tenant names are other customers' business."""
    return {
        "enabled": enabled,
        "scope": "tenant",
        "num_shared_prefix_tenants": len(set(shared_tenants)),
        "client_selectable": False,
        "rule": RULE,
    }
