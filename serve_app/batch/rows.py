"""One input row -> prompt token ids, SamplingParams and a grammar spec, or a RowError naming
what is wrong with the row (the job goes on; the row becomes a `failed` output row).

Plain functions over a dict row and a prompt encoder: no Ray, no engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from actors.sampling_params import SamplingParams
from serve_app import errors
from serve_app.access import client_json
from serve_app.access.output_budget import output_budget
from serve_app.checkpoints.prompt_encoding import PromptEncoder, UnsafePromptError
from serve_app.grammar.spec import GrammarSpec
from serve_app.protocol.params import ResponseFormat, response_format_spec

PROMPT_COLUMNS = ("prompt", "prompt_token_ids", "messages")
# Per-row sampling columns (null = the job's default); names and ranges as SamplingParams.
SAMPLING_COLUMNS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
)
_INT_COLUMNS = frozenset({"max_tokens", "top_k", "seed", "min_tokens"})
SHORTHAND_GRAMMARS = {"json_schema": "json_schema", "regex": "regex", "choice": "choice",
                      "grammar": "ebnf"}  # fmt: skip


@dataclass(frozen=True)
class BatchDefaults:
    """What a row gets when its own column is absent or null (the CLI flags)."""

    # A cap: a row without max_tokens gets min(max_tokens, the context left after its prompt).
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        # Bad defaults fail the job at once, naming the field, not every row one by one.
        object.__setattr__(self, "stop", tuple(self.stop))
        SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=self.stop,
        )


class RowError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _value(row: dict[str, Any], name: str) -> Any:
    """A column's value, None when absent or null; pandas writes missing numbers as NaN and
    nullable integers as floats, so those are read back as what they stand for."""
    value = row.get(name)
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if name in _INT_COLUMNS and value.is_integer():
            return int(value)
    return value


def prompt_token_ids(row: dict[str, Any], prompts: PromptEncoder) -> list[int]:
    given = [name for name in PROMPT_COLUMNS if _value(row, name) is not None]
    if len(given) != 1:
        found = f"got {', '.join(given)}" if given else "all are missing or null"
        raise RowError(
            "invalid_request", f"give exactly one of prompt, prompt_token_ids, messages ({found})"
        )
    name, value = given[0], _value(row, given[0])
    if name == "prompt":
        if not isinstance(value, str) or not value:
            raise RowError("invalid_request", "prompt: must be a non-empty string")
        return _as_text(prompts, value)
    if name == "prompt_token_ids":
        if not isinstance(value, list) or not value:
            raise RowError("invalid_request", "prompt_token_ids: must be a non-empty list")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise RowError("invalid_request", "prompt_token_ids: must be integers")
        return list(value)
    return _render_chat(value, prompts)


def _as_text(prompts: PromptEncoder, text: str) -> list[int]:
    """A text prompt is client text: never encoded as control tokens."""
    try:
        return prompts.encode_text([text])[0]
    except UnsafePromptError as exc:
        raise RowError("invalid_request", f"prompt: {exc}") from None


def _render_chat(messages: Any, prompts: PromptEncoder) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise RowError("invalid_request", "messages: must be a non-empty list")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RowError("invalid_request", f"messages[{i}]: must be a {{role, content}} object")
        # Parquet structs carry every field of the column's type; unset ones come back null.
        message = {k: v for k, v in message.items() if v is not None}
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise RowError("invalid_request", f"messages[{i}].role: must be a non-empty string")
        if not isinstance(message.get("content", ""), str):
            raise RowError("invalid_request", f"messages[{i}].content: must be a string")
        clean.append(message)
    if not prompts.chat_template:
        raise RowError("invalid_request", "messages: this model has no chat template")
    try:
        # Control-token text in the content stays text; the template wrote the real ones.
        return prompts.render(clean, add_generation_prompt=True)
    except UnsafePromptError as exc:
        raise RowError("invalid_request", f"messages: {exc}") from None
    except Exception as exc:  # noqa: BLE001 (a template error is about this row's input)
        raise RowError("invalid_request", f"messages: chat template failed: {exc}") from None


def check_prompt(ids: list[int], vocab_size: int, max_model_len: int) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        message = f"prompt_token_ids: {bad} is outside the vocabulary [0, {vocab_size})"
        raise RowError("invalid_request", message)
    if len(ids) >= max_model_len:
        raise RowError(
            "context_length_exceeded",
            f"the model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{len(ids)}, leaving no room for output",
        )


def sampling_params(
    row: dict[str, Any], defaults: BatchDefaults, num_prompt_tokens: int, max_model_len: int
) -> SamplingParams:
    max_tokens = _value(row, "max_tokens")
    if max_tokens is None or (isinstance(max_tokens, int) and not isinstance(max_tokens, bool)):
        try:
            max_tokens = output_budget(
                max_tokens,
                default=defaults.max_tokens,  # lowered to the room the prompt leaves
                caps=[],
                context=max_model_len,
                prompt_lengths=[num_prompt_tokens],
                prompt_param="prompt",
            )
        except errors.APIError as exc:
            raise RowError(exc.code, exc.message) from None
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": defaults.temperature,
        "top_p": defaults.top_p,
        "seed": defaults.seed,
        "stop": defaults.stop,
    }
    fields.update({k: v for k in SAMPLING_COLUMNS if (v := _value(row, k)) is not None})
    stop = _value(row, "stop")
    if stop is not None:
        fields["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
    try:
        return SamplingParams(**fields)
    except ValueError as exc:  # its messages start with the field name
        raise RowError("invalid_request", str(exc)) from None


def row_timeout(row: dict[str, Any]) -> float | None:
    """The `timeout` column: the row's deadline in seconds from when the engine takes it
    (as the HTTP API's `timeout`); reached while running, the row fails with `timeout`."""
    value = _value(row, "timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise RowError("invalid_request", "timeout: must be a number of seconds > 0")
    return float(value)


def grammar_spec(raw: Any) -> GrammarSpec | None:
    """The `response_format` column: JSON text in one of two shapes.

    - OpenAI's: {"type": "text" | "json_object"} or
      {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}
    - shorthand, exactly one key: {"json_schema": {...}}, {"regex": "..."},
      {"choice": ["a", "b"]} or {"grammar": "<EBNF>"}
    """
    if raw is None or raw == "":
        return None
    if not isinstance(raw, str):
        raise RowError("invalid_request", "response_format: must be a JSON string")
    try:
        spec = client_json.loads(raw, "response_format")
    except errors.APIError as exc:
        raise RowError("invalid_request", exc.message) from None
    if not isinstance(spec, dict):
        raise RowError("invalid_request", "response_format: must be a JSON object")
    if "type" in spec:
        return _openai_format(spec)
    if len(spec) != 1 or next(iter(spec)) not in SHORTHAND_GRAMMARS:
        raise RowError(
            "invalid_request",
            'response_format: expected {"type": ...} or exactly one of json_schema, regex, '
            f"choice, grammar (got {', '.join(sorted(spec)) or 'nothing'})",
        )
    key, value = next(iter(spec.items()))
    kind = SHORTHAND_GRAMMARS[key]
    if kind == "json_schema":
        if not isinstance(value, dict | bool):
            raise RowError("invalid_grammar", "response_format.json_schema: must be a schema")
        return GrammarSpec.json_schema(value)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise RowError("invalid_grammar", "response_format.choice: a non-empty string list")
        return GrammarSpec.choice(value)
    if not isinstance(value, str) or not value:
        raise RowError("invalid_grammar", f"response_format.{key}: must be a non-empty string")
    return GrammarSpec(kind, value)


def _openai_format(spec: dict[str, Any]) -> GrammarSpec | None:
    try:
        rf = ResponseFormat.model_validate(spec)
    except ValidationError as exc:
        reasons = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'response_format'}: {e['msg']}" for e in exc.errors()
        )
        raise RowError("invalid_request", f"response_format: {reasons}") from None
    except errors.APIError as exc:  # the schema's limits or exactness (grammar.schema_check)
        raise RowError(exc.code, exc.message) from None
    return response_format_spec(rf)
