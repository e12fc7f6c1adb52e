"""How a structured generation's text becomes its terminal status, on inputs no model should
produce but a `json_object` format admits (no Ray)."""

from __future__ import annotations

from serve_app.resources.resource import settle_structured

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_valid_output_completes_with_its_value() -> None:
    outcome = settle_structured('{"city": "Paris"}', "city", SCHEMA)
    assert (outcome.status, outcome.finish_reason) == ("completed", "stop")


def test_output_nested_past_the_recursion_limit_fails_as_invalid_output() -> None:
    # A json_object grammar bounds no depth: 100,000 levels make json.loads recurse out.
    deep = "[" * 100_000 + "]" * 100_000
    outcome = settle_structured(deep, "any", {})
    assert outcome.status == "failed"
    assert outcome.error["code"] == "invalid_output"
