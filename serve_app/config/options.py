"""ServeConfig: one pydantic model for the whole service, loadable from YAML.

Bad config fails at startup with a message naming the field.
"""

from __future__ import annotations

import functools
import ipaddress
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve_app.access.keys import DEFAULT_TENANT, KeysFile, load_keys_file
from serve_app.access.prefix_scope import check_shared_tenants
from serve_app.config.profiles import GenerationOptions

STORE_SCHEMES = ("sqlite:///", "postgresql://", "postgres://")


class EngineOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tensor_parallel_size: int = Field(1, ge=1)
    num_replicas: int = Field(1, ge=1)
    # STRICT_PACK keeps one replica (bundle 0) and its TP ranks on one node. PACK or SPREAD
    # let ranks straddle nodes (NCCL over the network): a deliberate opt-in.
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD"] = "STRICT_PACK"
    # A replica whose placement group is not placed within this fails the deployment.
    placement_timeout_s: float = Field(60.0, gt=0)
    # Engine bundles ask for one GPU per rank; None: whether the cluster has GPUs at startup.
    use_gpu: bool | None = None
    # Resources of the replica itself (bundle 0); TP ranks get their own bundles.
    replica_cpus: float = Field(1.0, gt=0)
    dtype: str | None = None
    max_model_len: int | None = Field(None, ge=2)
    max_num_seqs: int = Field(64, ge=1)
    # The engine's default (actors.config.DEFAULT_MAX_NUM_BATCHED_TOKENS; why 2,048 there).
    max_num_batched_tokens: int = Field(2048, ge=1)
    # None: the platform's (128 tokens on CPU, 16 on CUDA; actors.platform.default_block_size).
    block_size: int | None = Field(None, ge=1)
    kv_cache_bytes: int = Field(512 * 1024**2, ge=1)
    enable_prefix_caching: bool = True
    # Cached prefixes are keyed by tenant; the tenants listed here pool one shared cache
    # (their cached prefixes are visible to each other: cached_tokens and timing).
    shared_prefix_tenants: tuple[Annotated[str, Field(min_length=1, max_length=128)], ...] = ()
    seed: int = 0
    # Backpressure: a request whose reader is this many outputs behind is held (not
    # scheduled, KV kept); held longer than `hold_timeout_s` it ends as `slow_consumer`.
    output_queue_size: int = Field(64, ge=2)
    hold_timeout_s: float = Field(30.0, gt=0)
    # Fault injection for tests and benchmarks only: every engine step takes this much
    # longer (a slow model without a slow machine). Keep 0 in production.
    step_delay_s: float = Field(0.0, ge=0)
    # Server-side deadlines: the total time of a request that names none, and the longest
    # wait for a first token (past it: 503 deadline_unmeetable). None: unbounded.
    default_timeout_s: float | None = Field(600.0, gt=0)
    max_queue_s: float | None = Field(60.0, gt=0)
    # Speculative decoding, vLLM's names (docs/speculative-decoding.md); None: off.
    speculative_config: dict[str, Any] | None = None

    @field_validator("speculative_config")
    @classmethod
    def _check_speculative(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        from actors.spec_decode.config import SpeculativeConfig

        spec = SpeculativeConfig.from_dict(value)
        return spec.as_dict() if spec else None


class GrammarOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Refuse to start when xgrammar cannot initialise for the tokenizer.
    strict_structured_output: bool = False
    # Offer strict thinking (requests' `strict_thinking`: the mask also holds inside the
    # reasoning span); needs token filtering, so the server refuses to start without it.
    strict_thinking: bool = False
    compile_timeout_s: float = Field(10.0, gt=0)
    # Test/benchmark knob (fault injection): every compilation that misses the cache takes
    # this many seconds longer, so grammar/prefill overlap can be measured. 0 in production.
    compile_delay_s: float = Field(0.0, ge=0)
    cache_bytes: int = Field(64 * 1024**2, ge=0)
    # xgrammar threads per compile worker.
    max_threads: int = Field(4, ge=1)
    # Compile worker processes (each compiles one grammar at a time; one that runs past
    # compile_timeout_s is killed and replaced), the compiles that may wait for one, and the
    # longest wait while all are busy; past either: 503 overloaded (docs/structured-output.md).
    compile_workers: int = Field(2, ge=1)
    max_compile_queue: int = Field(8, ge=0)
    max_compile_queue_wait_s: float = Field(2.0, gt=0)
    # Largest schema / regex / grammar text accepted, in bytes.
    max_spec_bytes: int = Field(64 * 1024, ge=1)
    # Schema complexity, checked before anything compiles (400 request_limit_exceeded): how
    # deeply JSON objects/arrays nest in a schema, and how many JSON values it holds (also the
    # most choices). Measured: nesting is what makes compiles slow (docs/structured-output.md).
    max_schema_depth: int = Field(64, ge=2)
    max_schema_nodes: int = Field(4096, ge=1)


class LimitOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(4 * 1024**2, ge=1024)
    max_n: int = Field(16, ge=1)
    # Upper bound on max_tokens; None: whatever the context leaves.
    max_output_tokens: int | None = Field(None, ge=1)
    max_stop_sequences: int = Field(8, ge=0)
    max_prompts_per_request: int = Field(64, ge=1)
    # Tool definitions per request, and their JSON size in bytes.
    max_tools: int = Field(128, ge=0)
    max_tool_bytes: int = Field(256 * 1024, ge=1)


class IngressOptions(BaseModel):
    """The HTTP ingress deployment (every family's routes)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Ingress replicas behind Serve's proxy. They share nothing but the store: any replica
    # reads, chains, cancels and resumes what another accepted (each answer names its
    # replica in `x-served-by`).
    num_replicas: int = Field(1, ge=1)


class ResponseOptions(BaseModel):
    """Settings of `/v1/responses` (its responses live in the same store as generations)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # A stored response is kept this long (OpenAI's 30 days), then reads as absent and is
    # purged; chaining to it (previous_response_id) ends with it.
    retention_s: float = Field(30 * 24 * 3600.0, gt=0)
    purge_interval_s: float = Field(300.0, gt=0)


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # A checkpoint folder, or a .gguf file (dequantized once into a cached folder, which
    # `model` then names; docs/checkpoints.md).
    model: str
    # The id clients send as `model`; defaults to the checkpoint folder's name (a GGUF's stem).
    served_model_name: str | None = None
    # A Jinja chat template file that replaces the checkpoint's own (`--chat-template`).
    chat_template: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    admin_port: int = Field(8001, ge=0, le=65535)
    admin_host: str = "127.0.0.1"
    # Bearer key for the admin API; required to bind it off loopback.
    admin_api_key: str | None = None
    api_keys_file: str | None = None
    # Read from api_keys_file at startup, so replicas on other nodes never need the file.
    api_keys: KeysFile | None = None
    # Durable state of /v1/generations: None (SQLite in generations.data_dir),
    # sqlite:///PATH or postgresql://...
    store: str | None = None
    ray_address: str | None = None
    # The ingress replica serves `host:port` itself (Serve's direct ingress) instead of Serve's
    # proxy, which moves to a port the OS picks: less CPU per streamed token (docs/operations.md).
    direct_ingress: bool = False
    # Ingress, tokenizer and grammar (CPU only) run on the Ray head node, not on GPU nodes.
    cpu_deployments_on_head: bool = True
    # How long a completed request's result is kept for replay under its X-Request-Id.
    request_id_retention_s: float = Field(600.0, ge=0)
    # Test builds only: a request carrying `X-Fault-Injection: internal_error` fails inside
    # the server once authenticated (a 500), so the conformance suite can show that class.
    fault_injection: bool = False
    engine: EngineOptions = EngineOptions()
    grammar: GrammarOptions = GrammarOptions()
    limits: LimitOptions = LimitOptions()
    generations: GenerationOptions = GenerationOptions()
    responses: ResponseOptions = ResponseOptions()
    ingress: IngressOptions = IngressOptions()

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        self._resolve_gguf()
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(
                f"model: {self.model} is not a checkpoint folder (no config.json) nor a .gguf file"
            )
        if self.chat_template is not None:
            from serve_app.checkpoints.chat_templates import load_chat_template

            load_chat_template(self.chat_template)
        if self.api_keys_file is not None and self.api_keys is None:
            self.api_keys = load_keys_file(self.api_keys_file)
        if self.store is not None and not self.store.startswith(STORE_SCHEMES):
            raise ValueError(f"store: {self.store!r} is not sqlite:///PATH or postgresql://...")
        self.generations.check_models(self.model_id)
        self._check_output_format_limits()
        tenants = {k.tenant for k in self.api_keys.keys} if self.api_keys else {DEFAULT_TENANT}
        check_shared_tenants(self.engine.shared_prefix_tenants, tenants)
        if self.direct_ingress and self.port == 0:
            raise ValueError("port: direct_ingress needs a fixed port (Serve binds it by number)")
        if not is_loopback(self.host) and self.api_keys is None:
            raise ValueError(
                f"host: refusing to bind {self.host} (not loopback) without API keys "
                "(api_keys_file)"
            )
        if not is_loopback(self.admin_host) and not self.admin_api_key:
            raise ValueError(
                f"admin_host: refusing to bind {self.admin_host} (not loopback) without "
                "admin_api_key"
            )
        return self

    def _resolve_gguf(self) -> None:
        """A GGUF file is served from its converted folder (built on first use, cached by the
        file's hash); unsupported architectures and quant types fail here, naming them."""
        from actors.models.gguf import gguf_checkpoint, is_gguf_path

        if not is_gguf_path(self.model):
            return
        gguf = Path(self.model)
        self.model = str(gguf_checkpoint(gguf))
        if self.served_model_name is None:
            self.served_model_name = gguf.stem

    def _check_output_format_limits(self) -> None:
        from serve_app.config.profiles import constrained_schema
        from serve_app.grammar.schema_limits import (
            SchemaLimitExceeded,
            SchemaLimits,
            check_schema_limits,
        )

        limits = SchemaLimits(self.grammar.max_schema_depth, self.grammar.max_schema_nodes)
        for name, schema in self.generations.output_formats.items():
            try:
                check_schema_limits(constrained_schema(schema), limits)
            except SchemaLimitExceeded as exc:
                where = f"generations.output_formats.{name}"
                raise ValueError(f"{where}: {exc} (grammar.{exc.limit})") from None

    @property
    def model_id(self) -> str:
        return self.served_model_name or _folder_name(self.model)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: object) -> ServeConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)


@functools.lru_cache(maxsize=64)
def _folder_name(model: str) -> str:
    """A checkpoint's folder name. Read on every request, and resolving the path stats each
    of its parts (it showed in a profile of the ingress's own work per request)."""
    return Path(model).resolve().name


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
