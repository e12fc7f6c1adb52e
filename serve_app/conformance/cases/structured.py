"""Constrained outputs (JSON schema, JSON object, regex, choice) and tool-call deltas."""

from __future__ import annotations

import json
import re
from typing import Any

from serve_app.conformance.cases.base import (
    case,
    chat_body,
    raw_stream,
    sdk_create,
    with_token_ids,
)
from serve_app.conformance.observe import chat_generation, stream_generations
from serve_app.conformance.record import CaseRecord
from serve_app.conformance.session import Session

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _constrained(
    s: Session, record: CaseRecord, fields: dict[str, Any], may_truncate: bool = False
) -> dict[str, Any]:
    fields = {"max_tokens": 64, "temperature": 0, **fields}
    body = with_token_ids(s, chat_body(s, "Answer.", **fields))
    whole = sdk_create(s, record, "request", body)
    gen = chat_generation(whole["choices"][0], greedy=True)
    record.outputs["generation"] = gen
    finishes = ("stop", "length") if may_truncate else ("stop",)
    record.check(gen["finish_reason"] in finishes, f"finish_reason {gen['finish_reason']!r}")
    return gen


@case("json-schema-valid", "response_format json_schema: the output is valid against the schema")
def json_schema_valid(s: Session, record: CaseRecord) -> None:
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
    gen = _constrained(s, record, {"response_format": fmt})
    try:
        jsonschema.validate(json.loads(gen["text"]), PERSON_SCHEMA)
        valid = True
    except (ValueError, jsonschema.ValidationError) as exc:
        valid = record.check(False, f"{gen['text']!r} is not valid: {str(exc)[:200]}")
    record.observation["valid"] = valid


@case(
    "json-object-valid",
    "response_format json_object: the output is one JSON object (a prefix of one when cut by "
    "max_tokens)",
)
def json_object_valid(s: Session, record: CaseRecord) -> None:
    fields = {"response_format": {"type": "json_object"}, "max_tokens": 256}
    gen = _constrained(s, record, fields, may_truncate=True)
    text = gen["text"]
    if gen["finish_reason"] == "length":
        # An object with no bound on its strings may outrun max_tokens: what came is a prefix.
        record.notes["cut_by_max_tokens"] = True
        valid = text.lstrip().startswith("{") and is_json_prefix(text)
    else:
        try:
            valid = isinstance(json.loads(text), dict)
        except ValueError:
            valid = False
    record.check(valid, f"{text[:200]!r} is not a JSON object")
    record.observation["valid"] = valid


# What may complete a cut JSON text: the rest of a string (an escape, a \u sequence), a
# missing value, key or literal tail; then the open containers are closed.
_STRING_TAILS = [f"{pad}\"{after}" for pad in ("", "n", "0", "00", "000", "0000")
                 for after in ("", ":null")]  # fmt: skip
_VALUE_TAILS = ["", "null", ":null", '"k":null', "0", "e", "ue", "rue", "lse", "alse", "se",
                "l", "ll", "ull"]  # fmt: skip


def is_json_prefix(text: str) -> bool:
    """Whether `text` is the start of some JSON value (a completion of it parses)."""
    closers, in_string, escaped = [], False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            closers.append("}" if ch == "{" else "]")
        elif ch in "}]" and (not closers or closers.pop() != ch):
            return False
    tails = _STRING_TAILS if in_string else _VALUE_TAILS
    end = "".join(reversed(closers))
    for tail in tails:
        try:
            json.loads(text + tail + end)
            return True
        except ValueError:
            continue
    return False


REGEX = r"[a-z]{3,8}-[0-9]{2}"


@case("regex-valid", "structured_outputs regex: the whole output matches")
def regex_valid(s: Session, record: CaseRecord) -> None:
    gen = _constrained(s, record, {"structured_outputs": {"regex": REGEX}})
    valid = re.fullmatch(REGEX, gen["text"]) is not None
    record.check(valid, f"{gen['text']!r} does not match {REGEX}")
    record.observation["valid"] = valid


CHOICES = ["harbour", "lighthouse", "dock"]


@case("choice-valid", "structured_outputs choice: the output is one of the choices")
def choice_valid(s: Session, record: CaseRecord) -> None:
    gen = _constrained(s, record, {"structured_outputs": {"choice": CHOICES}})
    valid = gen["text"] in CHOICES
    record.check(valid, f"{gen['text']!r} is not one of {CHOICES}")
    record.observation["valid"] = valid


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Lisbon", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@case(
    "tool-call-deltas",
    "a forced tool call streams its name whole before any argument, calls never interleave",
)
def tool_call_deltas(s: Session, record: CaseRecord) -> None:
    body = chat_body(
        s,
        "What is the weather in Oslo?",
        max_tokens=64,
        temperature=0,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
    )
    whole = sdk_create(s, record, "non_streamed", body)
    stream = raw_stream(s, record, "streamed", "/v1/chat/completions", body)
    gen = chat_generation(whole["choices"][0], greedy=True)
    record.outputs["generation"] = gen
    record.check(gen["finish_reason"] == "tool_calls", f"finish_reason {gen['finish_reason']!r}")
    calls = gen["tool_calls"] or []
    record.check(len(calls) == 1, f"{len(calls)} tool calls with parallel_tool_calls false")
    for call in calls:
        record.check(call["name"] == "get_weather", f"tool name {call['name']!r}")
        try:
            args = json.loads(call["arguments"])
        except (TypeError, ValueError):
            args = None
        record.check(
            isinstance(args, dict) and args.get("city") in ("Paris", "Lisbon", "Oslo"),
            f"arguments {call['arguments']!r} do not match the tool's schema",
        )
    wrong = _delta_order(stream.chunks)
    for message in wrong:
        record.check(False, message)
    streamed = stream_generations(stream, greedy=True, chat=True)
    if streamed:
        record.check(streamed[0]["tool_calls"] == gen["tool_calls"], "streamed calls differ")
        record.check(streamed[0]["finish_reason"] == gen["finish_reason"], "streamed finish")
    record.observation["deltas_ok"] = not wrong


def _delta_order(chunks: list[dict[str, Any]]) -> list[str]:
    """Per call: the first delta has `id`, `type` and the whole name; later ones only argument
    fragments; once a later call starts, an earlier one gets nothing more."""
    wrong: list[str] = []
    started: list[int] = []
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            for call in (choice.get("delta") or {}).get("tool_calls") or []:
                index, function = call.get("index"), call.get("function") or {}
                if index not in started:
                    started.append(index)
                    if not (call.get("id") and function.get("name")):
                        wrong.append(f"call {index}: its first delta has no id or no name")
                    continue
                if index != started[-1]:
                    wrong.append(f"call {index} continues after call {started[-1]} started")
                if function.get("name") or call.get("id"):
                    wrong.append(f"call {index}: name or id sent again after its first delta")
    return wrong
