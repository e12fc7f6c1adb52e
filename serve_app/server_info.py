"""GET /v1/server_info: what this deployment serves, enforces and promises, as data."""

from __future__ import annotations

from typing import Any

from serve_app import errors, outcomes
from serve_app.access import client_json
from serve_app.access.keys import KeyLimits
from serve_app.access.prefix_scope import prefix_cache_info
from serve_app.backpressure import proxy_hold as proxy_flow
from serve_app.checkpoints.prompt_encoding import TOKENIZATION_RULES
from serve_app.config.options import ServeConfig
from serve_app.config.profiles import generations_info
from serve_app.errors.fault_injection import fault_injection_info
from serve_app.generations.conversations import conversations_info
from serve_app.openai.request_ids import MAX_ID_CHARS
from serve_app.parsers.chat_output import DEFAULT_TOOL_PARSER
from serve_app.parsers.reasoning import ThinkReasoningParser
from serve_app.parsers.tools import parser_versions
from serve_app.resources.idempotency import MAX_IDEMPOTENCY_KEY_CHARS
from serve_app.responses.info import responses_info

# Fields that change nothing here: accepted and ignored (never one that changes output).
IGNORED_FIELDS = ["user", "metadata", "store", "service_tier"]


def tool_calling_info(config: ServeConfig) -> dict[str, Any]:
    return {
        "parsers": parser_versions(),
        "parser": DEFAULT_TOOL_PARSER,
        "reasoning_parser": {
            "name": ThinkReasoningParser.name,
            "version": ThinkReasoningParser.version,
        },
        "tool_choice": ["none", "auto", "required", "named function"],
        "enforced_by_grammar": ["required", "named function"],
        "tools_executed": False,
        "strict_thinking": bool(getattr(config.grammar, "strict_thinking", False)),
    }


def server_info(config: ServeConfig, identity: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": config.model_id,
        "artifact": {
            "weights_sha256": identity["weights_sha256"],
            "tokenizer_sha256": identity["tokenizer_sha256"],
            "chat_template_sha256": identity["chat_template_sha256"],
            "chat_template_source": identity.get("chat_template_source"),
            # Set when the weights were dequantized from a GGUF file (docs/checkpoints.md).
            "gguf_sha256": identity.get("gguf_sha256"),
            "gguf_quant_type": identity.get("gguf_quant_type"),
            "fingerprint": identity["fingerprint"],
            "architecture": identity["architecture"],
            "dtype": identity["dtype"],
        },
        "grammar_backend": identity.get("grammar", {}),
        "structured_output": {
            "enforced_during_decode": bool(identity.get("grammar", {}).get("available")),
            "kinds": ["json_object", "json_schema", "regex", "grammar", "choice"],
            "strict_structured_output": config.grammar.strict_structured_output,
            "json_schema_refs": "local only ('#', '#/...'); any other $ref is 400 invalid_grammar",
            "exactness": "a constraint is enforced exactly or refused (400 invalid_grammar), "
            "never widened",
            "compile_pool": {
                "workers": config.grammar.compile_workers,
                "max_queue": config.grammar.max_compile_queue,
                "max_queue_wait_s": config.grammar.max_compile_queue_wait_s,
                "saturated": "503 overloaded with Retry-After",
                "timeout": "counted from the start of compilation on a worker of its own; "
                "past it the worker is killed: 400 invalid_grammar (the spec's fault)",
            },
        },
        "limits": {
            "max_model_len": identity["max_model_len"],
            "max_body_bytes": config.limits.max_body_bytes,
            "max_n": config.limits.max_n,
            "max_output_tokens": config.limits.max_output_tokens,
            "max_stop_sequences": config.limits.max_stop_sequences,
            "max_grammar_spec_bytes": config.grammar.max_spec_bytes,
            "grammar_compile_timeout_s": config.grammar.compile_timeout_s,
            "max_schema_depth": config.grammar.max_schema_depth,
            "max_schema_nodes": config.grammar.max_schema_nodes,
            "max_top_logprobs": 20,
            "max_json_depth": client_json.MAX_JSON_DEPTH,
        },
        "request_input": request_input_info(),
        "tool_calling": {
            **tool_calling_info(config),
            # False: the chat template ignores `tools`, so requests naming them are refused.
            "chat_template_renders_tools": identity.get("chat_template_renders_tools", True),
        },
        "auth": {
            "api_keys_required": config.api_keys is not None,
            "scheme": "Authorization: Bearer <key>",
            "per_key_limits": sorted(KeyLimits.model_fields),
            "other_tenants_resources": "404, never revealed",
        },
        "parameter_policy": {
            "unknown_fields": "400 unknown_parameter, naming the field",
            "unsupported_fields": "400 unsupported_parameter, naming the field",
            "ignored_fields": IGNORED_FIELDS,
        },
        "token_id_prompts": "special tokens are not added to token-id prompts",
        "tokenization": TOKENIZATION_RULES,
        "deadlines": {
            "client": "X-Request-Timeout-Ms header or the `timeout` field (seconds)",
            "default_timeout_s": config.engine.default_timeout_s,
            "max_queue_s": config.engine.max_queue_s,
            "too_short_even_when_idle": "400 deadline_too_short",
            "queue_makes_it_unmeetable": "503 deadline_unmeetable with Retry-After",
            "reached_while_running": "finish_reason timeout",
        },
        "backpressure": {
            "output_queue_size": config.engine.output_queue_size,
            "hold_timeout_s": config.engine.hold_timeout_s,
            "past_hold_timeout": "finish_reason abort, stop_reason slow_consumer",
            "stalled_client": stalled_client_info(config.direct_ingress),
        },
        "disconnect_policy": {
            "openai": "a request is cancelled when its client disconnects",
            "generations": (
                "never cancelled by a disconnect: a generation runs to its end or its deadline "
                "(generations.deadline_s, or its profile's deadline_s) and stays retrievable; "
                "a stalled stream reader is detached; only POST /v1/generations/{id}/cancel "
                "cancels"
            ),
            "responses": (
                "a stored response (store: true, the default) runs outside its request: a "
                "disconnect never cancels it, only POST /v1/responses/{id}/cancel does; a "
                "store: false response is cancelled with its request and nothing is kept"
            ),
        },
        "generations": generations_info(config.generations, config.store),
        "responses": responses_info(config.responses.retention_s),
        "conversations": conversations_info(config.generations.retention_s),
        "determinism": (
            "a per-request seed gives the same tokens regardless of batch mates on CPU fp32; "
            "best effort on GPU in bf16"
        ),
        "errors": errors.TAXONOMY,
        "fault_injection": fault_injection_info(config.fault_injection),
        "outcomes": outcomes.published(),
        "engine": {
            "tensor_parallel_size": config.engine.tensor_parallel_size,
            "replicas": config.engine.num_replicas,
            "max_num_seqs": config.engine.max_num_seqs,
            "block_size": config.engine.block_size,
            "prefix_caching": config.engine.enable_prefix_caching,
            "speculative_config": config.engine.speculative_config,
        },
        "prefix_cache": prefix_cache_info(
            config.engine.enable_prefix_caching, config.engine.shared_prefix_tenants
        ),
    }


def request_input_info() -> dict[str, Any]:
    """What a request's body and identity headers must be (each refusal: 400 invalid_request
    naming the field or header)."""
    return {
        "json": (
            f"a body, or JSON given as a string (structured_outputs.json), nests at most "
            f"{client_json.MAX_JSON_DEPTH} levels of arrays and objects; NaN and Infinity are "
            "not JSON"
        ),
        "text": "every string is Unicode text: a lone UTF-16 surrogate escape (\\ud800) is "
        "refused, naming the field",
        "X-Request-Id": {"max_chars": MAX_ID_CHARS, "charset": "printable characters"},
        "Idempotency-Key": {
            "max_chars": MAX_IDEMPOTENCY_KEY_CHARS,
            "charset": "printable characters; surrounding whitespace is trimmed",
        },
        "echoed_text": f"client text in an error message is cut to {errors.MAX_ECHO_CHARS} "
        "characters",
        "routes": {
            "unknown_path": "404 not_found",
            "wrong_method": "405 method_not_allowed with an Allow header",
            "/-/routes": (
                "Serve's route table: needs an API key when the server has keys"
                if proxy_flow.is_enabled()
                else "Serve's route table: open here (the proxy hook is not installed); "
                "block it in front of the proxy"
            ),
            "/-/healthz": "open, answers only whether the proxy is healthy",
        },
    }


def stalled_client_info(direct_ingress: bool = False) -> dict[str, Any]:
    """How a client that stops reading an OpenAI stream is seen: where the socket is written
    (Serve's proxy, or the ingress replica itself with direct ingress, in the same hook)."""
    if not proxy_flow.is_enabled():
        return {"detected": False, "held_when": "the engine's output window fills"}
    writer = "ingress replica" if direct_ingress else "proxy"
    return {
        "detected": True,
        "held_when": (
            f"the {writer}'s write to the client has waited stall_s: the client left about "
            "socket_sndbuf_bytes + write_high_water_bytes of the stream unread beyond its "
            "own receive buffer"
        ),
        "stall_s": proxy_flow.STALL_S,
        "socket_sndbuf_bytes": 2 * proxy_flow.SOCKET_SNDBUF_BYTES,
        "write_high_water_bytes": proxy_flow.WRITE_HIGH_WATER_BYTES,
        "resumes_when": f"the {writer}'s write goes through",
    }
