"""API keys, tenants and permissions.

A keys file (YAML) lists keys by their SHA-256 hash, never in clear:

    keys:
      - id: team-a-prod              # named in logs and metrics instead of the key
        sha256: 9f86d081...           # `serve-app hash-key` prints it
        tenant: team-a                # resources are scoped to it (others see 404)
        models: ["*"]                 # model ids this key may use; "*" for all
        profiles: [support_reply_v3]  # generation profiles; "*" for all
        admin: false                  # may call the admin API
        limits: {max_concurrent_requests: 4, tokens_per_minute: 20000}

Without a keys file every request gets the open principal (tenant "default", everything
allowed); the config refuses a non-loopback bind in that case.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from serve_app import errors

DEFAULT_TENANT = "default"
ANY = "*"
# Where the admission middleware leaves the authenticated principal in the ASGI scope.
PRINCIPAL_STATE_KEY = "principal"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class KeyLimits(BaseModel):
    """Per-key limits; None means the server-wide limit (if any) applies alone."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_concurrent_requests: int | None = Field(None, ge=1)
    # Prompt + output tokens per sliding minute.
    tokens_per_minute: int | None = Field(None, ge=1)
    max_body_bytes: int | None = Field(None, ge=1)
    max_prompt_tokens: int | None = Field(None, ge=1)
    max_output_tokens: int | None = Field(None, ge=1)
    max_n: int | None = Field(None, ge=1)
    max_stop_sequences: int | None = Field(None, ge=0)
    max_grammar_bytes: int | None = Field(None, ge=1)
    max_tools: int | None = Field(None, ge=0)
    max_tool_bytes: int | None = Field(None, ge=1)


class KeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=128)
    sha256: str
    tenant: str = Field(min_length=1, max_length=128)
    models: tuple[str, ...] = (ANY,)
    profiles: tuple[str, ...] = (ANY,)
    admin: bool = False
    limits: KeyLimits = KeyLimits()

    @field_validator("sha256")
    @classmethod
    def _check_hash(cls, value: str) -> str:
        value = value.strip().lower()
        if not _HEX64.match(value):
            raise ValueError("must be the 64-hex-digit SHA-256 of the key (serve-app hash-key)")
        return value


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: tuple[KeyEntry, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> KeysFile:
        for attr in ("id", "sha256"):
            seen: set[str] = set()
            for entry in self.keys:
                value = getattr(entry, attr)
                if value in seen:
                    shown = value if attr == "id" else value[:12] + "..."
                    raise ValueError(f"keys: two entries share the {attr} {shown}")
                seen.add(value)
        return self


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def generate_key() -> str:
    return "sk-" + secrets.token_urlsafe(32)


def load_keys_file(path: str | Path) -> KeysFile:
    """Parse and validate a keys file; ValueError names the file and the field."""
    try:
        data: Any = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"api_keys_file: cannot read {path}: {exc}") from None
    try:
        return KeysFile.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"api_keys_file: {path}: {exc}") from None


# ----------------------------------------------------------------------- principals


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant that scopes resources, and what the key may do.

    `models` / `profiles` of None mean "any"."""

    tenant: str
    key_id: str | None
    models: frozenset[str] | None = None
    profiles: frozenset[str] | None = None
    is_admin: bool = False
    limits: KeyLimits = field(default_factory=KeyLimits)

    def can_use_model(self, model_id: str) -> bool:
        return self.models is None or model_id in self.models

    def can_use_profile(self, name: str) -> bool:
        return self.profiles is None or name in self.profiles

    @property
    def is_open(self) -> bool:
        """The principal of a server without API keys."""
        return self.key_id is None

    @classmethod
    def of_entry(cls, entry: KeyEntry) -> Principal:
        return cls(
            tenant=entry.tenant,
            key_id=entry.id,
            models=None if ANY in entry.models else frozenset(entry.models),
            profiles=None if ANY in entry.profiles else frozenset(entry.profiles),
            is_admin=entry.admin,
            limits=entry.limits,
        )


OPEN_PRINCIPAL = Principal(tenant=DEFAULT_TENANT, key_id=None)


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class KeyRing:
    """Looks keys up by their hash: the clear key is never stored or compared."""

    def __init__(self, keys: KeysFile) -> None:
        self._by_hash = {entry.sha256: Principal.of_entry(entry) for entry in keys.keys}

    def __len__(self) -> int:
        return len(self._by_hash)

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of an `Authorization: Bearer <key>` header, or 401."""
        token = bearer_token(authorization)
        if token is None:
            raise errors.invalid_api_key(
                "Missing API key: send it as 'Authorization: Bearer <key>'."
            )
        principal = self._by_hash.get(hash_key(token))
        if principal is None:
            raise errors.invalid_api_key("Invalid API key.")
        return principal


def principal_of(request: Any) -> Principal:
    """The caller of a Starlette request, as the admission middleware authenticated it.

    Routes the middleware leaves open (and apps run without API keys) get OPEN_PRINCIPAL."""
    state = request.scope.get("state") or {}
    principal = state.get(PRINCIPAL_STATE_KEY)
    return principal if principal is not None else OPEN_PRINCIPAL


def require_model(principal: Principal, model_id: str) -> None:
    """403 when the key may not use `model_id` (checked before any content is loaded)."""
    if not principal.can_use_model(model_id):
        raise errors.permission_denied(
            "model_not_permitted", f"This API key may not use the model '{model_id}'."
        )


def require_profile(principal: Principal, name: str) -> None:
    if not principal.can_use_profile(name):
        raise errors.permission_denied(
            "profile_not_permitted", f"This API key may not use the profile '{name}'."
        )


def authorize_admin(
    authorization: str | None, admin_key: str | None, keyring: KeyRing | None
) -> None:
    """The admin API's check: open when neither an admin key nor API keys are configured;
    otherwise the admin key, or an API key with the admin permission (403 without it)."""
    if admin_key is None and keyring is None:
        return
    token = bearer_token(authorization)
    is_admin_key = admin_key is not None and token is not None
    if is_admin_key and hmac.compare_digest(token.encode(), admin_key.encode()):
        return
    if keyring is None:
        raise errors.invalid_api_key("A valid admin key is required.")
    if not keyring.authenticate(authorization).is_admin:
        raise errors.permission_denied(
            "admin_not_permitted", "This API key does not have the admin permission."
        )
