"""The generation resource: its JSON shape, and how an engine outcome becomes a terminal
status (the generation column of the outcome table, `serve_app.outcomes`).

Structured results are parsed and validated here, before `completed`: a refusal object is
`refused` with empty output, a truncated value is `incomplete` with empty output (never
partial JSON, never invented values), a value that fails its schema is `failed`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import jsonschema

from serve_app import outcomes
from serve_app.config.profiles import TEXT_FORMAT
from serve_app.store.base import GenerationRecord

UNFINISHED = ("queued", "running")


def new_generation_id() -> str:
    return "gen_" + uuid.uuid4().hex


def resource_json(record: GenerationRecord) -> dict[str, Any]:
    """What clients see: the stored fields plus id, status and the times the store keeps."""
    return {
        "id": record.id,
        "object": "generation",
        "status": record.status,
        **record.data,
        "created_at": record.created_at,
        "expires_at": record.expires_at,
    }


@dataclass(frozen=True)
class Outcome:
    status: str
    finish_reason: str
    output: list[dict[str, Any]]
    error: dict[str, str] | None = None
    # The assistant turn a conversation records (completed generations only).
    reply_text: str | None = None


def failed(code: str, message: str) -> Outcome:
    return Outcome("failed", "error", [], {"code": code, "message": message})


def text_blocks(text: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text}] if text else []


def settle(
    engine_finish: str | None,
    text: str,
    output_format: str,
    schema: dict[str, Any] | None,
    *,
    cancelled: bool = False,
) -> Outcome:
    """Map how the engine ended (`stop`, `length`, `timeout`, `abort`, `error`) to the
    resource's terminal status, validating a structured value first."""
    structured = output_format != TEXT_FORMAT
    # Partial text is shown for text only: a structured value is all or nothing.
    partial = [] if structured else text_blocks(text)
    # An abort the client did not ask for is the engine dropping the generation.
    ending = "abort" if cancelled else "error" if engine_finish == "abort" else engine_finish
    status, finish = outcomes.generation_end(ending or "")
    if status == "failed":
        return failed("engine_lost", f"the engine ended the generation ({engine_finish})")
    if status != "completed":  # cancelled, or incomplete (output limit, deadline)
        return Outcome(status, finish, partial)
    if not structured:
        return Outcome("completed", "stop", text_blocks(text), reply_text=text)
    return settle_structured(text, output_format, schema or {})


def settle_structured(text: str, output_format: str, schema: dict[str, Any]) -> Outcome:
    try:
        value = json.loads(text)
    except ValueError:
        return failed("invalid_output", "the model's output is not valid JSON")
    except RecursionError:  # a json_object output may nest deeper than Python recurses
        return failed("invalid_output", "the model's output nests too deeply to check")
    if isinstance(value, dict) and set(value) == {"refusal"} and isinstance(value["refusal"], str):
        return Outcome("refused", "refusal", [])
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        return failed(
            "invalid_output", f"the output does not match '{output_format}': {exc.message}"
        )
    except RecursionError:
        return failed("invalid_output", "the model's output nests too deeply to check")
    block = {"type": "json", "format": output_format, "json": value}
    return Outcome("completed", "stop", [block], reply_text=json.dumps(value))


def usage(input_tokens: int, output_tokens: int, cached_tokens: int, kind: str) -> dict[str, Any]:
    """`kind`: estimate (at admission), provisional (while streaming), final (terminal)."""
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cached_input_tokens": cached_tokens,
        "kind": kind,
    }
