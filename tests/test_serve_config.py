"""The Serve config file route (`serve run` / `serve deploy`) builds the same graph."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import ServeDeploySchema

from serve_app.app import app_builder

CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "serve_config.yaml"


def test_serve_config_file_validates_and_builds_the_graph(model_dirs):
    data = yaml.safe_load(CONFIG.read_text())
    schema = ServeDeploySchema.model_validate(data)
    (app,) = schema.applications
    assert app.import_path == "serve_app.app:app_builder"
    args = {**app.args, "model": str(model_dirs("llama"))}
    built = call_user_app_builder_with_args_if_necessary(app_builder, args)
    # The ingress is the graph's root; it binds the three worker deployments.
    assert built._bound_deployment.name == "ingress"


def test_serve_config_with_a_bad_field_fails_naming_it(model_dirs):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_num_seqs"):
        app_builder({"model": str(model_dirs("llama")), "engine": {"max_num_seqs": 0}})


def test_strict_structured_output_refuses_to_start_when_xgrammar_cannot(model_dirs, monkeypatch):
    import xgrammar as xgr

    from serve_app.app import probe_grammar_backend
    from serve_app.config import ServeConfig

    def refuse(*args, **kwargs):
        raise RuntimeError("unsupported tokenizer")

    monkeypatch.setattr(xgr.TokenizerInfo, "from_huggingface", refuse)
    model = str(model_dirs("llama"))
    lenient = probe_grammar_backend(ServeConfig(model=model))
    assert (
        lenient["available"] is False and "unsupported tokenizer" in lenient["unavailable_reason"]
    )
    strict = ServeConfig(model=model, grammar={"strict_structured_output": True})
    with pytest.raises(RuntimeError, match="strict_structured_output"):
        probe_grammar_backend(strict)


def test_store_urls_other_than_sqlite_and_postgresql_are_refused(model_dirs):
    from pydantic import ValidationError

    from serve_app.config import ServeConfig

    model = str(model_dirs("llama"))
    with pytest.raises(ValidationError, match="store: 'mysql://db/x'"):
        ServeConfig(model=model, store="mysql://db/x")
    for url in ("sqlite:///x.db", "postgresql://user@db:5432/x"):
        assert ServeConfig(model=model, store=url).store == url
