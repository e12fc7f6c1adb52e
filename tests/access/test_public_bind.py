"""A public proxy address needs API keys on every deploy path: the ingress asks Serve where its
proxy listens (serve run / serve deploy set it in http_options, which ServeConfig never sees)."""

from __future__ import annotations

import pytest

from serve_app.access.keys import KeysFile
from serve_app.config.options import ServeConfig
from serve_app.config.public_bind import proxy_host, refuse_open_public_bind


def config(tmp_path, **fields) -> ServeConfig:
    (tmp_path / "config.json").write_text("{}")  # a checkpoint folder, as far as config goes
    return ServeConfig(model=str(tmp_path), **fields)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3"])
def test_a_public_proxy_address_without_keys_refuses_to_start(tmp_path, host):
    with pytest.raises(RuntimeError, match=r"http_options.host: refusing to serve on .*API keys"):
        refuse_open_public_bind(config(tmp_path), host)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", None])
def test_loopback_or_an_unknown_address_starts(tmp_path, host):
    refuse_open_public_bind(config(tmp_path), host)


def test_a_public_proxy_address_with_keys_starts(tmp_path):
    keys = KeysFile.model_validate({"keys": [{"sha256": "0" * 64, "id": "a", "tenant": "a"}]})
    refuse_open_public_bind(config(tmp_path, api_keys=keys), "0.0.0.0")


@pytest.mark.serve
@pytest.mark.ray
def test_the_session_proxy_is_found_on_loopback(serve_url):
    assert proxy_host() == "127.0.0.1"
