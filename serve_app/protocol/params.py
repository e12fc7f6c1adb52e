"""Request pieces shared by chat and completions: limits, parameter policy, sampling fields,
structured-output specs, and the mapping onto the engine's SamplingParams."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from serve_app import errors
from serve_app.access import client_json
from serve_app.grammar.schema_check import check_choices_carrier, check_schema_carrier
from serve_app.grammar.spec import GrammarSpec

if TYPE_CHECKING:
    from actors.sampling_params import SamplingParams

# ------------------------------------------------------------------------------ limits

MAX_N = 16
# OpenAI documents 4; evaluation harnesses routinely send more, so allow a bounded few more.
MAX_STOP = 16
# The detokenizer holds back text that may start a stop string: bound the hold-back.
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_PROMPTS = 32
# torch.Generator.manual_seed takes a signed 64-bit value.
MAX_SEED = 2**63 - 1

# -------------------------------------------------------------------- parameter policy

# Known OpenAI fields that change nothing here: accepted and dropped.
IGNORED_PARAMETERS = frozenset({"user", "metadata", "store", "service_tier"})
# Known OpenAI fields that would change the output but are not supported: rejected, unless
# the value is one that changes nothing (null, empty, false, best_of == n, ...).
UNSUPPORTED_PARAMETERS: dict[str, str] = {
    "logit_bias": "logit bias is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning effort is not supported",
    "verbosity": "verbosity control is not supported",
    "suffix": "insertion (suffix) is not supported",
    "best_of": "best_of other than n is not supported",
}


def _is_benign(name: str, value: Any, body: dict[str, Any]) -> bool:
    """Whether an unsupported parameter's value would leave the output unchanged."""
    if value is None or value is False or value == [] or value == {}:
        return True
    if name == "tool_choice":
        # Without tools there is nothing to choose from.
        return value in ("none", "auto")
    if name == "parallel_tool_calls":
        return isinstance(value, bool)
    if name == "modalities":
        return value == ["text"]
    if name == "best_of":
        return value == (body.get("n") or 1)
    if name == "suffix":
        return value == ""
    return False


def apply_parameter_policy(
    body: dict[str, Any], extra_unsupported: dict[str, str] | None = None
) -> dict[str, Any]:
    """Drop ignored and harmless fields; raise `unsupported_parameter` for the rest."""
    unsupported = {**UNSUPPORTED_PARAMETERS, **(extra_unsupported or {})}
    kept: dict[str, Any] = {}
    for name, value in body.items():
        if name in IGNORED_PARAMETERS:
            continue
        if name in unsupported:
            if _is_benign(name, value, body):
                continue
            raise errors.unsupported_parameter(name, unsupported[name])
        kept[name] = value
    return kept


# ------------------------------------------------------------------------ base models

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StrictModel(BaseModel):
    # Strict: "0.5" is not a number and 1.0 is not an integer; the client must fix it.
    model_config = STRICT


class StreamOptions(StrictModel):
    include_usage: bool | None = None


class JsonSchemaFormat(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    # NOTE: `schema` would shadow a BaseModel attribute; the alias is the wire name.
    schema_: dict[str, Any] = Field(alias="schema")
    # Constraints are always enforced, so strict=false changes nothing.
    strict: bool | None = None
    description: str | None = None

    @field_validator("schema_")
    @classmethod
    def _admit(cls, schema: dict[str, Any]) -> dict[str, Any]:
        check_schema_carrier(schema, "response_format.json_schema.schema")
        return schema


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' requires a 'json_schema' object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"'json_schema' is not allowed with type '{self.type}'")
        return self


class StructuredOutputs(StrictModel):
    """Extension: constrain the output by exactly one of a schema, regex, EBNF or choice."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1)

    @field_validator("json_")
    @classmethod
    def _parse_json(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | None:
        if not isinstance(value, str):
            if value is not None:
                check_schema_carrier(value, "structured_outputs.json")
            return value
        param = "structured_outputs.json"
        schema = client_json.loads(value, param, syntax_error=errors.invalid_grammar)
        if not isinstance(schema, dict):
            raise errors.invalid_grammar("schema must be a JSON object", "structured_outputs.json")
        check_schema_carrier(schema, param)
        return schema

    @field_validator("choice")
    @classmethod
    def _admit_choices(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            check_choices_carrier(value, "structured_outputs.choice")
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [v for v in (self.json_, self.regex, self.grammar, self.choice) if v is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'json', 'regex', 'grammar', 'choice'")
        return self


def response_format_spec(rf: ResponseFormat | None) -> GrammarSpec | None:
    """`response_format` as a spec (None for text), for every carrier of the OpenAI shape."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return GrammarSpec.json_object()
    assert rf.json_schema is not None  # ResponseFormat's validator guarantees it
    return GrammarSpec.json_schema(rf.json_schema.schema_)


class SamplingRequest(StrictModel):
    """Fields both endpoints share. None means "not given": defaults apply at conversion."""

    _grammar: GrammarSpec | None = PrivateAttr(default=None)
    _grammar_built: bool = PrivateAttr(default=False)

    model: str = Field(min_length=1)
    n: int | None = Field(None, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # -1 or 0 disables top-k.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # Client deadline in seconds, from arrival.
    timeout: float | None = Field(None, gt=0.0)
    # Extension (as vLLM names it): each choice carries its generated `token_ids` (a stream
    # chunk: its own), and the response the prompt's `prompt_token_ids`.
    return_token_ids: bool | None = None
    # Extension (as vLLM names it): each prompt token's logprob plus the top-k alternatives,
    # as `prompt_logprobs` (docs/logprobs.md).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
        for stop in stops:
            if not stop:
                raise ValueError("stop sequences must be non-empty")
            if len(stop) > MAX_STOP_CHARS:
                raise ValueError(f"stop sequences must be at most {MAX_STOP_CHARS} characters")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise ValueError("token ids must be >= 0")
        return value

    # ----------------------------------------------------------- cross-field rules

    def check_common(self, effective_max_tokens: int | None) -> None:
        """Rules across fields; raise APIError naming the parameter to fix."""
        if self.stream_options is not None and self.stream is not True:
            raise errors.invalid_request(
                "'stream_options' is only allowed when 'stream' is true.", "stream_options"
            )
        if self.prompt_logprobs is not None and self.stream:
            # As vLLM: the stream has no place for them (echo with logprobs has one).
            raise errors.invalid_request(
                "'prompt_logprobs' is not available when 'stream' is true.", "prompt_logprobs"
            )
        if (
            self.min_tokens is not None
            and effective_max_tokens is not None
            and self.min_tokens > effective_max_tokens
        ):
            raise errors.invalid_request("'min_tokens' must be <= max_tokens.", "min_tokens")
        rf = self.response_format
        if self.structured_outputs is not None and rf is not None and rf.type != "text":
            raise errors.invalid_request(
                "'structured_outputs' cannot be combined with a non-text 'response_format'.",
                "structured_outputs",
            )

    # -------------------------------------------------------------- conversions

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        return None

    def requested_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        # Duplicates would only cost detokenizer work.
        return tuple(dict.fromkeys(stops))

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The engine's parameters; `default_max_tokens` applies when the client gave none
        (the caller passes the context that remains after the prompt)."""
        # Imported here: the engine package pulls in torch, which the ingress never needs
        # until it converts a request.
        from actors.sampling_params import SamplingParams

        max_tokens = self.requested_max_tokens()
        fields: dict[str, Any] = {
            "n": self.n or 1,
            "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
            "min_tokens": self.min_tokens or 0,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": 0 if self.top_k is None else self.top_k,
            "min_p": self.min_p or 0.0,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": (
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            "seed": self.seed,
            "stop": self.stop_strings(),
            "stop_token_ids": tuple(dict.fromkeys(self.stop_token_ids or ())),
            "include_stop_str_in_output": bool(self.include_stop_str_in_output),
            "ignore_eos": bool(self.ignore_eos),
            "logprobs": self.requested_logprobs(),
            "prompt_logprobs": self.requested_prompt_logprobs(),
        }
        try:
            return SamplingParams(**fields)
        except ValueError as exc:
            # SamplingParams messages start with the field name.
            message = str(exc)
            raise errors.invalid_request(message, message.split(" ", 1)[0]) from None

    def grammar_spec(self) -> GrammarSpec | None:
        """The request's output constraint, built once per request (at admission) in its
        canonical form; None when the output is free text."""
        if not self._grammar_built:
            self._grammar, self._grammar_built = self._build_grammar_spec(), True
        return self._grammar

    def has_grammar(self) -> bool:
        """Whether the output is constrained, without building the constraint."""
        rf = self.response_format
        return self.structured_outputs is not None or (rf is not None and rf.type != "text")

    def _build_grammar_spec(self) -> GrammarSpec | None:
        so = self.structured_outputs
        if so is not None:
            if so.json_ is not None:
                return GrammarSpec.json_schema(so.json_)
            if so.regex is not None:
                return GrammarSpec.regex(so.regex)
            if so.grammar is not None:
                return GrammarSpec.ebnf(so.grammar)
            return GrammarSpec.choice(so.choice or [])
        return response_format_spec(self.response_format)

    def grammar_param(self) -> str | None:
        """Where the grammar came from, for an `invalid_grammar` error's `param`."""
        so = self.structured_outputs
        if so is not None:
            given = (("json", so.json_), ("regex", so.regex), ("grammar", so.grammar))
            for key, value in (*given, ("choice", so.choice)):
                if value is not None:
                    return f"structured_outputs.{key}"
        if self.response_format is not None and self.response_format.type == "json_schema":
            return "response_format.json_schema.schema"
        return "response_format" if self.response_format is not None else None
