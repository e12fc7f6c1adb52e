"""Generation profiles: bad config fails at startup naming the field; a structured format's
grammar admits the schema's values and the refusal object, and nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from serve_app.config.options import ServeConfig
from serve_app.config.profiles import GenerationOptions, Profile, constrained_schema
from serve_app.generations.protocol import GenerationCreate
from tests.support.grammar import accepts, compile_spec

DRAFT = {
    "type": "object",
    "properties": {"reply": {"$ref": "#/$defs/short"}, "urgent": {"type": "boolean"}},
    "required": ["reply", "urgent"],
    "additionalProperties": False,
    "$defs": {"short": {"type": "string", "maxLength": 8}},
}


def options(**overrides) -> GenerationOptions:
    data = {
        "output_formats": {"draft": DRAFT},
        "profiles": [{"name": "p", "output_formats": ["draft", "text"]}],
        **overrides,
    }
    return GenerationOptions.model_validate(data)


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        ({"profiles": [{"name": "p", "output_formats": ["nope"]}]}, "profiles.p.output_formats"),
        ({"profiles": [{"name": "p"}, {"name": "p"}]}, "duplicate name(s) p"),
        ({"output_formats": {"d": {"type": "array"}}, "profiles": []}, "output_formats.d"),
        ({"output_formats": {"d": {"type": "object", "properties": {"refusal": {}}}}}, "'refusal'"),
        ({"output_formats": {"d": {"type": 12}}}, "not a valid JSON Schema"),
        ({"output_formats": {"text": {"type": "object"}}}, "reserved"),
        ({"profiles": [{"name": "p", "default_max_output_tokens": 9, "max_output_tokens": 8}]},
         "default_max_output_tokens"),
    ],
)  # fmt: skip
def test_bad_generation_config_names_the_field(overrides: dict, names: str) -> None:
    with pytest.raises(ValidationError, match=names.replace("(", r"\(").replace(")", r"\)")):
        options(**overrides)


def test_a_profile_must_run_on_the_served_model(model_dirs) -> None:
    model = str(model_dirs("llama"))
    profile = Profile(name="p", models=("another-model",))
    with pytest.raises(ValidationError, match="generations.profiles.p.models"):
        ServeConfig(model=model, generations=GenerationOptions(profiles=(profile,)))
    served = Path(model).resolve().name
    ok = ServeConfig(model=model, generations={"profiles": [{"name": "p", "models": [served]}]})
    assert ok.generations.profile("p") is not None and ok.generations.profile("q") is None


def test_the_structured_grammar_admits_values_and_refusals_only(service, engine_cache) -> None:
    spec = json.dumps(constrained_schema(DRAFT))
    payload = compile_spec(service, "json_schema", spec)
    # The compiled JSON grammar writes ", " and ": " between items.
    assert accepts(engine_cache, payload, '{"reply": "hi", "urgent": false}')
    assert accepts(engine_cache, payload, '{"refusal": "cannot help"}')
    assert not accepts(engine_cache, payload, '{"reply": "far too long", "urgent": false}')
    assert not accepts(engine_cache, payload, '{"reply": "hi"}')
    assert not accepts(engine_cache, payload, '{"refusal": "no", "urgent": true}')
    assert not accepts(engine_cache, payload, '{"refusal": ""}')


def test_equal_requests_hash_equal_whatever_their_spelling() -> None:
    a = GenerationCreate.model_validate({"profile": "p", "input": "hi"})
    b = GenerationCreate.model_validate(
        {"input": [{"role": "user", "content": "hi"}], "execution": "sync", "profile": "p"}
    )
    c = GenerationCreate.model_validate({"profile": "p", "input": "hi", "execution": "stream"})
    assert a.body_hash() == b.body_hash() != c.body_hash()
