"""Builds the deployment graph from one ServeConfig. The only place `serve.deployment` is
applied: the services themselves are plain classes."""

from __future__ import annotations

from typing import Any

import ray
from ray import serve
from ray.serve import Application

from serve_app.config import ServeConfig
from serve_app.engine import EngineService, build_model_config
from serve_app.grammar import GrammarService
from serve_app.identity import artifact_identity
from serve_app.ingress import Ingress
from serve_app.metrics import record_grammar_compile
from serve_app.tokenizer import TokenizerService

APP_NAME = "serve-app"
# Engines batch internally; Serve's default of a few ongoing requests would serialise them.
ENGINE_MAX_ONGOING = 4096


def engine_bundles(config: ServeConfig) -> list[dict[str, float]] | None:
    """Bundle 0 is the replica itself; one bundle per TP rank after it."""
    e = config.engine
    if e.tensor_parallel_size == 1:
        return None
    has_gpus = ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
    rank_bundle = {"GPU": 1.0, "CPU": 1.0} if has_gpus else {"CPU": 1.0}
    return [{"CPU": e.replica_cpus}] + [dict(rank_bundle) for _ in range(e.tensor_parallel_size)]


def served_identity(config: ServeConfig, grammar_identity: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    model_config = build_model_config(config)
    template = AutoTokenizer.from_pretrained(config.model).chat_template
    identity = artifact_identity(config.model, template, extra=grammar_identity)
    identity.update(
        model=config.model_id,
        max_model_len=model_config.max_model_len,
        vocab_size=model_config.vocab_size,
        architecture=model_config.architecture,
        dtype=str(model_config.dtype).removeprefix("torch."),
    )
    return identity


def probe_grammar_backend(config: ServeConfig) -> dict[str, Any]:
    """Whether xgrammar works for this tokenizer, decided once at startup."""
    probe = GrammarService(config.model, max_threads=1)
    try:
        info = probe.identity()
    finally:
        probe.close()
    if not info["available"] and config.grammar.strict_structured_output:
        raise RuntimeError(
            "strict_structured_output is set but structured output cannot be enforced: "
            + info["unavailable_reason"]
        )
    if not info["available"] and config.grammar.strict_thinking:
        raise RuntimeError(
            "strict_thinking is set but it needs token filtering inside reasoning, which this "
            "tokenizer's grammar backend cannot do: " + info["unavailable_reason"]
        )
    return info


def build_app(config: ServeConfig) -> Application:
    model_config = build_model_config(config)
    identity = served_identity(config, {"grammar": probe_grammar_backend(config)})
    tokenizer = serve.deployment(
        TokenizerService,
        name="tokenizer",
        max_ongoing_requests=512,
        ray_actor_options={"num_cpus": 0},
    ).bind(config.model, model_config.vocab_size)
    grammar = serve.deployment(
        GrammarService,
        name="grammar",
        max_ongoing_requests=512,
        ray_actor_options={"num_cpus": 0},
    ).bind(
        config.model,
        max_threads=config.grammar.max_threads,
        cache_limit_bytes=config.grammar.cache_bytes,
        compile_timeout_s=config.grammar.compile_timeout_s,
        on_compile=record_grammar_compile,
    )
    bundles = engine_bundles(config)
    engine_options: dict[str, Any] = dict(
        name="engine",
        num_replicas=config.engine.num_replicas,
        max_ongoing_requests=ENGINE_MAX_ONGOING,
        health_check_period_s=2,
        health_check_timeout_s=30,
    )
    if bundles is None:
        engine_options["ray_actor_options"] = {"num_cpus": config.engine.replica_cpus}
    else:
        engine_options["placement_group_bundles"] = bundles
        engine_options["placement_group_strategy"] = config.engine.placement_strategy
    engine = serve.deployment(EngineService, **engine_options).bind(config)
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        name="ingress",
        max_ongoing_requests=ENGINE_MAX_ONGOING,
        ray_actor_options={"num_cpus": 0},
    ).bind(config, tokenizer, grammar, engine, identity)
    return ingress


def app_builder(args: dict[str, Any]) -> Application:
    """For `serve run serve_app.app:app_builder model=DIR ...` and Serve config files."""
    return build_app(ServeConfig.model_validate(args))
