"""Generation profiles and the generations API's settings (the `generations` part of
ServeConfig): server-owned instructions, allowed models and output formats, token budgets.

A structured output format is a named JSON Schema. What the model is constrained to is that
schema *or* a refusal object, `{"refusal": "<reason>"}`, so declining is a value the grammar
admits, never a malformed answer.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve_app.grammar.schema_subset import SchemaRefused, check_schema_subset

TEXT_FORMAT = "text"
REFUSAL_MAX_CHARS = 200
_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class Profile(BaseModel):
    """One documented combination of instructions, output rules and models."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=_NAME)
    version: str = Field("1", min_length=1, max_length=64)
    # The system prompt; callers never send one.
    instructions: str = ""
    # Model ids the profile may run on; empty: the served model.
    models: tuple[str, ...] = ()
    # Output formats a request may choose: "text" or names of `generations.output_formats`;
    # the first is the default.
    output_formats: tuple[str, ...] = (TEXT_FORMAT,)
    default_max_output_tokens: int = Field(256, ge=1)
    max_output_tokens: int = Field(1024, ge=1)
    # Most tokens the assembled input (instructions, history, input) may take; None: the
    # context length minus the request's output allowance.
    input_budget_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # Server deadline of this profile's generations (a quick task may need an answer in
    # seconds); None: generations.deadline_s.
    deadline_s: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> Profile:
        if not self.output_formats:
            raise ValueError(f"profiles.{self.name}.output_formats: name at least one format")
        if self.default_max_output_tokens > self.max_output_tokens:
            raise ValueError(
                f"profiles.{self.name}.default_max_output_tokens: "
                f"{self.default_max_output_tokens} exceeds max_output_tokens "
                f"{self.max_output_tokens}"
            )
        return self

    @property
    def default_output_format(self) -> str:
        return self.output_formats[0]


class GenerationOptions(BaseModel):
    """Settings of `/v1/generations` and `/v1/conversations`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    profiles: tuple[Profile, ...] = ()
    # Named JSON Schemas a profile may offer as output formats.
    output_formats: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # Where the default SQLite store lives (when `store` is not set); "~" is expanded.
    data_dir: str = "~/.local/share/serve-app"
    # Finished generations and idle conversations are kept this long, then purged.
    retention_s: float = Field(24 * 3600.0, gt=0)
    idempotency_ttl_s: float = Field(24 * 3600.0, gt=0)
    # Server deadline of one generation, from admission; reached while running: timeout.
    deadline_s: float = Field(600.0, gt=0)
    # An owner (server process) silent this long has its unfinished generations failed.
    orphan_after_s: float = Field(60.0, gt=0)
    purge_interval_s: float = Field(300.0, gt=0)

    @field_validator("output_formats")
    @classmethod
    def _check_formats(cls, formats: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name, schema in formats.items():
            where = f"generations.output_formats.{name}"
            if name == TEXT_FORMAT:
                raise ValueError(f"{where}: the name '{TEXT_FORMAT}' is reserved")
            try:
                jsonschema.validators.validator_for(schema).check_schema(schema)
            except jsonschema.SchemaError as exc:
                raise ValueError(f"{where}: not a valid JSON Schema: {exc.message}") from None
            if schema.get("type") != "object":
                raise ValueError(f'{where}: the top level must be {{"type": "object"}}')
            if "refusal" in schema.get("properties", {}):
                raise ValueError(f"{where}: 'refusal' is reserved for the refusal branch")
            try:  # enforced exactly or refused, as for a request's schema
                check_schema_subset(constrained_schema(schema))
            except SchemaRefused as exc:
                raise ValueError(f"{where}: {exc.reason}") from None
        return formats

    @model_validator(mode="after")
    def _check_profiles(self) -> GenerationOptions:
        names = [p.name for p in self.profiles]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"generations.profiles: duplicate name(s) {', '.join(duplicates)}")
        for p in self.profiles:
            for fmt in p.output_formats:
                if fmt != TEXT_FORMAT and fmt not in self.output_formats:
                    raise ValueError(
                        f"generations.profiles.{p.name}.output_formats: '{fmt}' is neither "
                        "'text' nor a name in generations.output_formats"
                    )
        return self

    def profile(self, name: str) -> Profile | None:
        return next((p for p in self.profiles if p.name == name), None)

    def check_models(self, served: str) -> None:
        """Every profile must be runnable here (called by ServeConfig with its model id)."""
        for p in self.profiles:
            for model in p.models:
                if model != served:
                    raise ValueError(
                        f"generations.profiles.{p.name}.models: '{model}' is not served here "
                        f"(this server serves '{served}')"
                    )


def refusal_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "refusal": {"type": "string", "minLength": 1, "maxLength": REFUSAL_MAX_CHARS}
        },
        "required": ["refusal"],
        "additionalProperties": False,
    }


def constrained_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` or the refusal object. Local `$defs`/`definitions` move to the top level so
    the schema's own `#/$defs/...` references still resolve inside the wrapper."""
    inner = {k: v for k, v in schema.items() if k not in ("$defs", "definitions", "$schema")}
    wrapped: dict[str, Any] = {"anyOf": [inner, refusal_schema()]}
    for key in ("$defs", "definitions"):
        if key in schema:
            wrapped[key] = schema[key]
    return wrapped


def format_instructions(name: str, schema: dict[str, Any]) -> str:
    """Appended to the profile's instructions for a structured format."""
    return (
        f"Answer with one JSON object in the format '{name}', matching this JSON Schema: "
        f"{json.dumps(schema, separators=(',', ':'))}. If you must decline, answer "
        '{"refusal": "<why>"} instead.'
    )


def generations_info(options: GenerationOptions, store_url: str | None) -> dict[str, Any]:
    """The generations API's promises, for /v1/server_info (instructions stay private)."""
    backend = "sqlite" if store_url is None or store_url.startswith("sqlite") else "postgresql"
    return {
        "profiles": [
            {
                "name": p.name,
                "version": p.version,
                "models": list(p.models),
                "output_formats": list(p.output_formats),
                "default_max_output_tokens": p.default_max_output_tokens,
                "max_output_tokens": p.max_output_tokens,
                "input_budget_tokens": p.input_budget_tokens,
                "deadline_s": p.deadline_s or options.deadline_s,
            }
            for p in options.profiles
        ],
        "output_formats": options.output_formats,
        "refusal_branch": refusal_schema(),
        "executions": ["sync", "stream", "background"],
        "stream_events": ["generation.created", "output.delta", "generation.finished"],
        "deadline_s": options.deadline_s,
        "retention_s": options.retention_s,
        "idempotency_ttl_s": options.idempotency_ttl_s,
        "context_overflow": "rejected: 422 context_length_exceeded naming the budget",
        "store": backend,
    }
