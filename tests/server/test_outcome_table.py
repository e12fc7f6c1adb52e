"""The outcome table is one table: what /v1/server_info publishes, what docs/outcomes.md shows,
and where every family's mapping of an engine ending comes from."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from actors.request import FinishReason
from serve_app import outcomes
from serve_app.protocol import openai_finish_reason
from serve_app.resources.resource import settle
from serve_app.responses.run import ResponseRun

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_page_shows_the_table_in_code():
    assert outcomes.markdown_table() in (ROOT / "docs" / "outcomes.md").read_text()


def test_every_engine_ending_has_a_row_and_a_word_in_each_family():
    for reason in FinishReason:
        row = outcomes._row(reason.value)
        assert row is not None, reason
        status, _ = outcomes.generation_end(reason.value)
        assert status in ("completed", "incomplete", "cancelled", "failed")
        if reason is FinishReason.ERROR:
            with pytest.raises(ValueError):  # an error frame or a 500, never a finish reason
                openai_finish_reason(reason.value)
        else:
            assert openai_finish_reason(reason.value)[0] == row.openai["finish_reason"]


@pytest.mark.parametrize(
    ("engine", "generation", "batch"),
    [
        ("stop", ("completed", "stop"), "completed"),
        ("length", ("incomplete", "output_limit"), "incomplete"),
        ("timeout", ("incomplete", "timeout"), "failed"),
        ("error", ("failed", "error"), "failed"),
    ],
)
def test_the_families_read_their_words_from_the_table(engine, generation, batch):
    outcome = settle(engine, "some text", "text", None)
    assert (outcome.status, outcome.finish_reason) == generation
    assert outcomes.batch_status(engine) == batch


def test_a_cancel_is_cancelled_only_when_the_client_asked():
    assert settle("abort", "", "text", None, cancelled=True).status == "cancelled"
    assert settle("abort", "", "text", None).status == "failed"  # the engine dropped it


def test_server_info_publishes_the_table():
    published = outcomes.published()
    assert [row["cause"] for row in published] == [row.cause for row in outcomes.OUTCOMES]
    assert published[6]["note"] == "generations detach from slow readers instead"


@pytest.mark.parametrize(
    ("finish", "stop_reason", "asked_to_cancel", "ending"),
    [
        ("stop", None, False, ("completed", None, None)),
        ("stop", "grammar_end", False, ("completed", None, None)),
        ("length", None, False, ("incomplete", "max_output_tokens", None)),
        ("timeout", None, False, ("incomplete", "timeout", None)),
        ("abort", None, True, ("cancelled", None, None)),
        ("abort", None, False, ("failed", None, "engine_lost")),  # nobody asked
        ("abort", "slow_consumer", False, ("failed", None, "slow_consumer")),
        ("error", None, False, ("failed", None, "engine_lost")),
        ("stop", None, True, ("completed", None, None)),  # completion wins a late cancel
    ],
)
def test_the_responses_column_through_a_response_run(finish, stop_reason, asked_to_cancel, ending):
    """Each row as `/v1/responses` ends: the run's terminal event and its response."""
    from tests.responses.test_run import admitted, output

    out = output("Hi", finish=FinishReason(finish))
    out.deltas[-1] = replace(out.deltas[-1], stop_reason=stop_reason)

    async def save(adm, final):
        return None

    def base(status, items, usage, error=None, incomplete_reason=None):
        return {"status": status, "error": error, "reason": incomplete_reason, "usage": usage}

    async def main():
        run = ResponseRun(admitted(), base, save, lambda: asked_to_cancel)
        return [e async for e in run.events(out, _nothing())]

    events = asyncio.run(main())
    final = events[-1]["response"]
    code = (final["error"] or {}).get("code")
    assert (final["status"], final["reason"], code) == ending
    assert events[-1]["type"] == f"response.{ending[0]}"
    assert final["usage"]["output_tokens"] == 1  # what it used, however it ended


async def _nothing():
    return
    yield
