"""Builds the deployment graph from one ServeConfig. The only place `serve.deployment` is
applied: the services themselves are plain classes."""

from __future__ import annotations

from typing import Any

import ray
from ray import serve
from ray.serve import Application

from actors.executor.ray_tp import bundles_use_gpu, rank_bundles
from actors.platform import default_block_size
from actors.tokenizer_file import load_tokenizer
from serve_app import ray_env
from serve_app.checkpoints.chat_templates import renders_tools, resolve_chat_template
from serve_app.checkpoints.identity import artifact_identity
from serve_app.config.options import ServeConfig
from serve_app.grammar.schema_limits import SchemaLimits
from serve_app.grammar.service import GrammarService
from serve_app.ingress import Ingress
from serve_app.metrics import record_grammar_compile
from serve_app.ops.admin_app import AdminServer
from serve_app.ops.stats import HEAD_ONLY
from serve_app.replicas import ResponsesReplica
from serve_app.workers.engine import EngineService, build_model_config
from serve_app.workers.tokenizer import TokenizerService

APP_NAME = "serve-app"
# Ray gives the head node this resource (1.0); asking for a sliver of it pins to the head.
HEAD_NODE_RESOURCE = "node:__internal_head__"
# Engines batch internally; Serve's default of a few ongoing requests would serialise them.
ENGINE_MAX_ONGOING = 4096
# How often a replica asked to stop looks for requests still in flight before it goes. Serve's
# default is 2 s, and an app's deployments stop in stages (the ingress, then what it calls):
# an idle graph took about 5 s longer to stop than its requests needed. In-flight requests are
# still waited for, up to Serve's graceful_shutdown_timeout_s.
SHUTDOWN_WAIT_LOOP_S = 0.5


def engine_uses_gpu(config: ServeConfig) -> bool:
    return bundles_use_gpu(config.engine.use_gpu)


def settle_block_size(config: ServeConfig) -> ServeConfig:
    """`config` with the engine's KV block size decided (the platform's default where the
    config names none: `actors.platform.default_block_size`), so that the engine and
    `/v1/server_info` name the same number."""
    if config.engine.block_size is not None:
        return config
    block_size = default_block_size(engine_uses_gpu(config))
    engine = config.engine.model_copy(update={"block_size": block_size})
    return config.model_copy(update={"engine": engine})


def engine_bundles(config: ServeConfig) -> list[dict[str, float]] | None:
    """Bundle 0 is the replica itself; one bundle per TP rank after it."""
    e = config.engine
    if e.tensor_parallel_size == 1:
        return None
    return [{"CPU": e.replica_cpus}] + rank_bundles(e.tensor_parallel_size, engine_uses_gpu(config))


def engine_placement(config: ServeConfig) -> dict[str, Any]:
    """Serve options that place one engine replica: a placement group when TP > 1 (packed on
    one node unless the config opts out), else the replica's own CPUs and GPU."""
    bundles = engine_bundles(config)
    if bundles is not None:
        return {
            "placement_group_bundles": bundles,
            "placement_group_strategy": config.engine.placement_strategy,
        }
    actor_options: dict[str, Any] = {"num_cpus": config.engine.replica_cpus}
    if engine_uses_gpu(config):
        actor_options["num_gpus"] = 1
    return {"ray_actor_options": actor_options}


def cpu_actor_options(config: ServeConfig) -> dict[str, Any]:
    """Ingress, tokenizer and grammar ask for no GPU and, on a cluster, sit on the head node
    (Serve spreads replicas over nodes, so zero CPUs alone could land them on a GPU node)."""
    options: dict[str, Any] = {"num_cpus": 0}
    if config.cpu_deployments_on_head:
        options["resources"] = {HEAD_NODE_RESOURCE: 0.001}
    return options


def served_identity(config: ServeConfig, grammar_identity: dict[str, Any]) -> dict[str, Any]:
    model_config = build_model_config(config)
    tokenizer = load_tokenizer(config.model)
    template = resolve_chat_template(config.chat_template, tokenizer.chat_template)
    tokenizer.chat_template = template.text
    identity = artifact_identity(config.model, template.text, extra=grammar_identity)
    identity.update(
        chat_template_source=template.label,
        chat_template_renders_tools=renders_tools(tokenizer),
        model=config.model_id,
        max_model_len=model_config.max_model_len,
        vocab_size=model_config.vocab_size,
        architecture=model_config.architecture,
        dtype=str(model_config.dtype).removeprefix("torch."),
    )
    return identity


def schema_limits(config: ServeConfig) -> SchemaLimits:
    return SchemaLimits(config.grammar.max_schema_depth, config.grammar.max_schema_nodes)


def probe_grammar_backend(config: ServeConfig) -> dict[str, Any]:
    """Whether xgrammar works for this tokenizer, decided once at startup."""
    probe = GrammarService(config.model, max_threads=1, prestart=False)
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


def admin_deployment(config: ServeConfig) -> Application:
    """The admin API as one replica of the app: it comes up with every deploy path and goes
    with the app. On the head, as the proxy: a loopback bind must be the head's loopback."""
    return serve.deployment(
        AdminServer,
        name="admin",
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
        num_replicas=1,
        max_ongoing_requests=512,
        ray_actor_options={"num_cpus": 0, "resources": dict(HEAD_ONLY)},
    ).bind(
        config.model_id, config.admin_host, config.admin_port, config.admin_api_key, config.api_keys
    )


def app_identity(config: ServeConfig) -> dict[str, Any]:
    """What `/v1/server_info` names: the artifact's hashes and the grammar backend's probe."""
    return served_identity(config, {"grammar": probe_grammar_backend(config)})


def build_app(config: ServeConfig, identity: dict[str, Any] | None = None) -> Application:
    """The graph for `config`; `identity` is `app_identity(config)`, computed here unless the
    caller has it already (serve_app/server.py computes it while Ray starts)."""
    if identity is None:
        identity = app_identity(config)
    config = settle_block_size(config)
    tokenizer = serve.deployment(
        TokenizerService,
        name="tokenizer",
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
        max_ongoing_requests=512,
        ray_actor_options=cpu_actor_options(config),
    ).bind(config.model, resolve_chat_template(config.chat_template, None))
    grammar = serve.deployment(
        GrammarService,
        name="grammar",
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
        max_ongoing_requests=512,
        ray_actor_options=cpu_actor_options(config),
    ).bind(
        config.model,
        max_threads=config.grammar.max_threads,
        cache_limit_bytes=config.grammar.cache_bytes,
        compile_timeout_s=config.grammar.compile_timeout_s,
        on_compile=record_grammar_compile,
        compile_delay_s=config.grammar.compile_delay_s,
        num_workers=config.grammar.compile_workers,
        max_queue=config.grammar.max_compile_queue,
        max_queue_wait_s=config.grammar.max_compile_queue_wait_s,
        schema_limits=schema_limits(config),
    )
    engine_options: dict[str, Any] = dict(
        name="engine",
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
        num_replicas=config.engine.num_replicas,
        max_ongoing_requests=ENGINE_MAX_ONGOING,
        health_check_period_s=2,
        health_check_timeout_s=30,
        **engine_placement(config),
    )
    engine = serve.deployment(EngineService, **engine_options).bind(config)
    # Stored /v1/responses run here, not in the ingress replica that accepted them: they
    # outlive it (serve_app/responses/service.py). One replica: every live response in one
    # process, followed from memory by any ingress replica.
    responses = serve.deployment(
        ResponsesReplica,
        name="responses",
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
        num_replicas=1,
        max_ongoing_requests=ENGINE_MAX_ONGOING,
        ray_actor_options=cpu_actor_options(config),
    ).bind(config, engine, grammar, identity)
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        name="ingress",
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
        num_replicas=config.ingress.num_replicas,
        max_ongoing_requests=ENGINE_MAX_ONGOING,
        ray_actor_options=cpu_actor_options(config),
    ).bind(config, tokenizer, grammar, engine, identity, admin_deployment(config), responses)
    return ingress


# Serve's own settings on the `serve run` / `serve deploy` paths (http_options).
SERVE_OWNED_FIELDS = ("host", "port")


def app_builder(args: dict[str, Any]) -> Application:
    """For `serve run serve_app.app:app_builder model=DIR ...` and Serve config files
    (docs/deploy.md). The HTTP address there is Serve's `http_options`, so `host` and `port`
    are refused rather than ignored."""
    for field in SERVE_OWNED_FIELDS:
        if field in args:
            raise ValueError(
                f"{field}: `serve run` and `serve deploy` take the HTTP address from the Serve "
                f"config's http_options.{field}, not from the app's args (docs/deploy.md)"
            )
    if not ray.is_initialized():
        # `serve run IMPORT_PATH` builds the app before it starts Ray: the Ray it starts
        # inherits the settings its proxy and replicas need (ray_env).
        ray_env.prepare()
    return build_app(ServeConfig.model_validate(args))
