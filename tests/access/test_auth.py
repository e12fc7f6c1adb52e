"""API keys, principals and the admission middleware, without Ray: the keys file, the config's
public-bind rule, `hash-key`, and 401 / 413 on a small Starlette app behind the middleware."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serve_app import errors
from serve_app.access.keys import (
    OPEN_PRINCIPAL,
    KeyRing,
    KeysFile,
    authorize_admin,
    hash_key,
    load_keys_file,
    principal_of,
)
from serve_app.access.middleware import AccessMiddleware


def keys_file(**extra_keys: dict) -> KeysFile:
    entries = [
        {"id": "a-prod", "sha256": hash_key("key-a"), "tenant": "a", "models": ["m1"]},
        {
            "id": "b-ops",
            "sha256": hash_key("key-b"),
            "tenant": "b",
            "admin": True,
            "profiles": ["support_reply_v3"],
            "limits": {"max_body_bytes": 64},
        },
    ]
    for key, entry in extra_keys.items():
        entries.append({"sha256": hash_key(key), **entry})
    return KeysFile.model_validate({"keys": entries})


# ---------------------------------------------------------------------- keys file


def test_a_key_maps_to_its_tenant_permissions_and_limits():
    ring = KeyRing(keys_file())
    a = ring.authenticate("Bearer key-a")
    assert (a.tenant, a.key_id, a.is_admin) == ("a", "a-prod", False)
    assert a.can_use_model("m1") and not a.can_use_model("m2")
    assert a.can_use_profile("anything")  # profiles default to "*"
    b = ring.authenticate("bearer key-b")  # the scheme is case-insensitive
    assert b.is_admin and b.can_use_profile("support_reply_v3")
    assert not b.can_use_profile("support_draft_v1")
    assert b.limits.max_body_bytes == 64


@pytest.mark.parametrize("header", [None, "", "Bearer ", "Basic a2V5LWE=", "key-a", "Bearer nope"])
def test_missing_or_wrong_keys_are_401(header):
    with pytest.raises(errors.APIError) as info:
        KeyRing(keys_file()).authenticate(header)
    assert (info.value.status, info.value.code) == (401, "invalid_api_key")
    assert info.value.headers["x-should-retry"] == "false"


def test_keys_file_stores_hashes_only_and_rejects_bad_entries(tmp_path: Path):
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": [{"id": "x", "sha256": "key-a", "tenant": "t"}]}))
    with pytest.raises(ValueError, match="SHA-256"):
        load_keys_file(path)
    digest = hash_key("k")
    twice = [{"id": i, "sha256": digest, "tenant": "t"} for i in ("x", "y")]
    path.write_text(yaml.safe_dump({"keys": twice}))
    with pytest.raises(ValueError, match="share the sha256"):
        load_keys_file(path)
    path.write_text(
        yaml.safe_dump(
            {
                "keys": [
                    {"id": "x", "sha256": digest, "tenant": "t", "limits": {"max_concurents": 3}}
                ]
            }
        )
    )
    with pytest.raises(ValueError, match="max_concurents"):
        load_keys_file(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_keys_file(tmp_path / "absent.yaml")


def test_hash_key_command_hashes_stdin_and_makes_new_keys(monkeypatch, capsys):
    import io

    from serve_app.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("key-a\n"))
    assert main(["hash-key"]) == 0
    assert capsys.readouterr().out.strip() == hash_key("key-a")
    assert main(["hash-key", "--new"]) == 0
    lines = dict(line.split(": ") for line in capsys.readouterr().out.strip().splitlines())
    assert lines["key"].startswith("sk-") and lines["sha256"] == hash_key(lines["key"])


# ------------------------------------------------------------------------- config


def test_public_host_needs_api_keys(model_dirs, tmp_path: Path):
    from pydantic import ValidationError

    from serve_app.config.options import ServeConfig

    model = str(model_dirs("llama"))
    with pytest.raises(ValidationError, match="refusing to bind 0.0.0.0"):
        ServeConfig(model=model, host="0.0.0.0")
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump(keys_file().model_dump(mode="json")))
    config = ServeConfig(model=model, host="0.0.0.0", api_keys_file=str(path))
    # Loaded once, so replicas on other nodes never read the file.
    assert config.api_keys is not None and len(config.api_keys.keys) == 2
    path.write_text("keys: []\n")
    with pytest.raises(ValidationError, match="api_keys_file"):
        ServeConfig(model=model, api_keys_file=str(path))


# -------------------------------------------------------------------- admin check


def test_admin_needs_the_admin_key_or_an_admin_permission():
    ring = KeyRing(keys_file())
    authorize_admin(None, None, None)  # nothing configured: open (loopback only)
    authorize_admin("Bearer adm", "adm", ring)
    authorize_admin("Bearer key-b", "adm", ring)
    cases = [
        ("Bearer key-a", 403, "admin_not_permitted"),
        (None, 401, "invalid_api_key"),
        ("Bearer wrong", 401, "invalid_api_key"),
    ]
    for header, status, code in cases:
        with pytest.raises(errors.APIError) as info:
            authorize_admin(header, "adm", ring)
        assert (info.value.status, info.value.code) == (status, code)
    with pytest.raises(errors.APIError) as info:
        authorize_admin("Bearer key-b", "adm", None)  # API keys not configured on admin
    assert info.value.status == 401


# -------------------------------------------------------------------- middleware


def gated_app(keys: KeysFile | None, max_body_bytes: int = 1024) -> Starlette:
    async def echo(request: Request) -> Response:
        body = await request.body()
        p = principal_of(request)
        return JSONResponse({"tenant": p.tenant, "key": p.key_id, "bytes": len(body)})

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, errors.APIError)
        return exc.response()

    from starlette.middleware import Middleware

    ring = KeyRing(keys) if keys is not None else None
    return Starlette(
        routes=[Route("/health", echo), Route("/v1/echo", echo, methods=["POST"])],
        exception_handlers={errors.APIError: on_api_error},
        middleware=[
            Middleware(AccessMiddleware, keyring=ring, limiter=None, max_body_bytes=max_body_bytes)
        ],
    )


def call(app: Starlette, method: str, path: str, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.request(method, path, **kwargs)

    return asyncio.run(go())


def test_without_keys_everyone_is_the_open_default_tenant():
    r = call(gated_app(None), "POST", "/v1/echo", content=b"{}")
    assert r.json() == {"tenant": "default", "key": None, "bytes": 2}
    assert OPEN_PRINCIPAL.can_use_model("any") and OPEN_PRINCIPAL.tenant == "default"


def test_middleware_authenticates_before_the_route_and_leaves_health_open():
    app = gated_app(keys_file())
    r = call(app, "POST", "/v1/echo", content=b"{}")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.headers["x-should-retry"] == "false"
    r = call(app, "POST", "/v1/echo", content=b"{}", headers={"Authorization": "Bearer key-a"})
    assert r.json() == {"tenant": "a", "key": "a-prod", "bytes": 2}
    assert call(app, "GET", "/health").status_code == 200


def test_body_cap_applies_per_key_with_or_without_content_length():
    app = gated_app(keys_file(), max_body_bytes=1024)
    big = b"x" * 200
    # key-b's own limit (64 bytes) is below the server's 1024.
    headers = {"Authorization": "Bearer key-b"}
    r = call(app, "POST", "/v1/echo", content=big, headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert "64 bytes" in r.json()["error"]["message"]

    async def chunks():
        for _ in range(10):
            yield b"y" * 40

    # A chunked body declares no length: the cap fires while reading, on the 2nd chunk.
    r = call(app, "POST", "/v1/echo", content=chunks(), headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = call(app, "POST", "/v1/echo", content=big, headers={"Authorization": "Bearer key-a"})
    assert r.status_code == 200 and r.json()["bytes"] == 200
    r = call(
        app, "POST", "/v1/echo", content=b"z" * 2000, headers={"Authorization": "Bearer key-a"}
    )
    assert r.status_code == 413 and json.loads(r.content)["error"]["param"] is None
