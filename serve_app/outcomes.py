"""How a request can end, and what each API family calls it: the one outcome table.

Each row is a cause, the engine's signal for it (its finish reason, and the stop reason that
tells two causes apart), and the family's words: an OpenAI `finish_reason` (`stop_reason`),
a generation resource's `status` / `finish_reason`, a batch row's `status`. `/v1/server_info`
publishes the table as it is here; docs/outcomes.md shows it (a test keeps the two equal);
the OpenAI formatter, the generation resource and the batch engine read their mapping from
it. A cause decided above the engine (a refusal branch) has no engine signal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OutcomeRow:
    cause: str
    # (finish reason, stop reason) as the engine reports it; None: decided above the engine.
    engine: tuple[str, str | None] | None
    openai: dict[str, str] | str | None
    generation: dict[str, str] | None
    batch: dict[str, str] | None
    note: str | None = None
    # A response's `status` / `incomplete_details.reason` (or its error's code).
    responses: dict[str, str] | str | None = None


OUTCOMES: tuple[OutcomeRow, ...] = (
    OutcomeRow(
        "EOS or stop token/string",
        ("stop", None),
        {"finish_reason": "stop", "stop_reason": "the matched stop"},
        {"status": "completed", "finish_reason": "stop"},
        {"status": "completed"},
        responses={"status": "completed"},
    ),
    OutcomeRow(
        "grammar complete, no continuation but the end",
        ("stop", "grammar_end"),
        {"finish_reason": "stop", "stop_reason": "grammar_end"},
        {"status": "completed", "finish_reason": "stop", "note": "value validated"},
        {"status": "completed"},
        responses={"status": "completed"},
    ),
    OutcomeRow(
        "max tokens",
        ("length", None),
        {"finish_reason": "length"},
        {"status": "incomplete", "finish_reason": "output_limit"},
        {"status": "incomplete"},
        responses={"status": "incomplete", "reason": "max_output_tokens"},
    ),
    OutcomeRow(
        "refusal branch taken",
        None,
        None,
        {"status": "refused", "finish_reason": "refusal"},
        {"status": "completed", "note": "refusal text"},
    ),
    OutcomeRow(
        "deadline reached while running",
        ("timeout", None),
        {"finish_reason": "timeout"},
        {"status": "incomplete", "finish_reason": "timeout"},
        {"status": "failed", "error_code": "timeout"},
        responses={"status": "incomplete", "reason": "timeout"},
    ),
    OutcomeRow(
        "client cancel / disconnect",
        ("abort", None),
        {"finish_reason": "abort", "note": "stream already closed"},
        {"status": "cancelled", "finish_reason": "cancelled"},
        None,
        responses={
            "status": "cancelled",
            "note": "POST /v1/responses/{id}/cancel; a disconnect cancels only a store: false "
            "response, which keeps nothing",
        },
    ),
    OutcomeRow(
        "slow consumer past its hold deadline",
        ("abort", "slow_consumer"),
        {"finish_reason": "abort", "stop_reason": "slow_consumer"},
        None,
        None,
        note="generations detach from slow readers instead",
        responses={
            "status": "failed",
            "error_code": "slow_consumer",
            "note": "store: false only; a stored response keeps its events for slow readers",
        },
    ),
    OutcomeRow(
        "engine or worker lost, internal error",
        ("error", None),
        "error frame / 500",
        {"status": "failed", "finish_reason": "error", "error_code": "engine_lost"},
        {"status": "failed", "note": "transient"},
        responses={"status": "failed", "error_code": "engine_lost"},
    ),
)


def published() -> list[dict[str, Any]]:
    """The table as `/v1/server_info` lists it."""
    rows = []
    for row in OUTCOMES:
        item: dict[str, Any] = {
            "cause": row.cause,
            "openai": row.openai,
            "generation": row.generation,
            "batch": row.batch,
            "responses": row.responses,
        }
        if row.note is not None:
            item["note"] = row.note
        rows.append(item)
    return rows


def _row(finish_reason: str, stop_reason: Any = None) -> OutcomeRow | None:
    """The row of an engine signal: the one naming its stop reason, else the plain one."""
    plain = None
    for row in OUTCOMES:
        if row.engine is None or row.engine[0] != finish_reason:
            continue
        if row.engine[1] is not None and row.engine[1] == stop_reason:
            return row
        if row.engine[1] is None:
            plain = row
    return plain


def openai_finish(finish_reason: str) -> str | None:
    """OpenAI's `finish_reason` for an engine finish reason; None: it has none (an engine
    failure is an error frame or a 500, never a finish reason)."""
    row = _row(finish_reason)
    return row.openai.get("finish_reason") if row and isinstance(row.openai, dict) else None


def generation_end(finish_reason: str) -> tuple[str, str]:
    """A generation resource's (status, finish_reason) for an engine finish reason; an
    ending the table does not name is the engine's failure."""
    row = _row(finish_reason)
    if row is None or row.generation is None:
        row = _row("error")
    assert row is not None and row.generation is not None
    return row.generation["status"], row.generation["finish_reason"]


def batch_status(finish_reason: str | None) -> str:
    """A batch row's status for an engine finish reason (unexpected ones: failed)."""
    row = _row(finish_reason or "")
    return row.batch["status"] if row is not None and row.batch is not None else "failed"


def response_end(finish_reason: str, stop_reason: Any = None) -> tuple[str, str | None]:
    """A response's (status, incomplete reason or error code) for an engine ending; an
    ending the table does not name is the engine's failure."""
    row = _row(finish_reason, stop_reason)
    if row is None or not isinstance(row.responses, dict):
        row = _row("error")
    assert row is not None and isinstance(row.responses, dict)
    words = row.responses
    return words["status"], words.get("reason") or words.get("error_code")


def markdown_table() -> str:
    """The table as docs/outcomes.md shows it."""

    def cell(value: dict[str, str] | str | None, *keys: str) -> str:
        if value is None:
            return "—"
        if isinstance(value, str):
            return value
        words = " / ".join(f"`{value[k]}`" for k in keys if k in value)
        extra = [value[k] for k in ("stop_reason", "error_code", "note") if k in value]
        return words + (f" ({', '.join(extra)})" if extra else "")

    lines = [
        "| cause | OpenAI `finish_reason` (`stop_reason`) | generation `status` / "
        "`finish_reason` | batch `status` | response `status` (`incomplete_details.reason`, "
        "error `code`) |",
        "|---|---|---|---|---|",
    ]
    for row in OUTCOMES:
        generation = cell(row.generation, "status", "finish_reason")
        if row.generation is None and row.note:
            generation = f"— ({row.note})"
        lines.append(
            f"| {row.cause} | {cell(row.openai, 'finish_reason')} | {generation} | "
            f"{cell(row.batch, 'status')} | {cell(row.responses, 'status', 'reason')} |"
        )
    return "\n".join(lines) + "\n"
