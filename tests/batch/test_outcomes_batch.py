"""The outcome vocabulary of `serve-app batch`, one case per row of the outcome table
(serve_app/outcomes.py) that a batch row can reach (a row has no client to cancel or to read
slowly), plus a bad row; each row's expected status is the batch column of `/v1/server_info`'s
`outcomes`.

One pipeline run (Ray Data, as the CLI runs it) holds every constructed row; the engine-lost row
runs the same engine callable in-process with its executor failing, as
tests/batch/test_batch.py's recovery test does."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from serve_app.batch.job import BatchDefaults, run_batch
from serve_app.batch.parquet_io import is_transient
from serve_app.outcomes import published

Check = Callable[[dict[str, Any]], None]
MAX_TOKENS = 1000  # of the deadline row: far more than its timeout lets it make
TIMEOUT_S = 0.5
STEP_DELAY_S = 0.002
# The refusal object alone, short enough to finish well within the row's max_tokens.
REFUSAL_ONLY = {
    "type": "object",
    "properties": {"refusal": {"type": "string", "minLength": 1, "maxLength": 12}},
    "required": ["refusal"],
    "additionalProperties": False,
}
ENGINE_LOST = "engine or worker lost, internal error"
BAD_ROW = "a bad row (the row's fault, not a table row)"


def check_stop(row: dict[str, Any]) -> None:
    assert row["finish_reason"] == "stop" and row["completion_tokens"] < 200


def check_grammar_end(row: dict[str, Any]) -> None:
    # min_tokens forbids ending at the choice's end: nothing but the end was left.
    assert row["text"] in ("yes", "no") and row["finish_reason"] == "stop"


def check_length(row: dict[str, Any]) -> None:
    assert row["finish_reason"] == "length" and row["completion_tokens"] == 3


def check_refusal(row: dict[str, Any]) -> None:
    # To a batch row the refusal object is a value like any other: the refusal is its text.
    value = json.loads(row["text"])
    assert list(value) == ["refusal"] and value["refusal"]


def check_timeout(row: dict[str, Any]) -> None:
    assert row["finish_reason"] == "timeout" and row["text"] is None
    assert 0 < row["completion_tokens"] < MAX_TOKENS  # the tokens it made are counted


def check_lost(row: dict[str, Any]) -> None:
    assert row["error_code"] == "engine_error" and "worker lost" in row["error_message"]


def check_bad(row: dict[str, Any]) -> None:
    assert "timeout" in row["error_message"] and row["completion_tokens"] == 0


# cause: (the input row, what else its output row must show)
CASES: dict[str, tuple[dict[str, Any], Check]] = {
    "EOS or stop token/string": (
        {"prompt": "Once upon a time", "stop": [" ", "e", "a", "o", "t"], "max_tokens": 200},
        check_stop,
    ),
    "grammar complete, no continuation but the end": (
        {"prompt": "Answer:", "response_format": json.dumps({"choice": ["yes", "no"]}),
         "min_tokens": 30, "max_tokens": 40},
        check_grammar_end,
    ),
    "max tokens": ({"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}, check_length),
    "refusal branch taken": (
        {"prompt": "Decline:", "response_format": json.dumps({"json_schema": REFUSAL_ONLY}),
         "max_tokens": 64},
        check_refusal,
    ),
    BAD_ROW: ({"prompt": "Hello", "timeout": -1.0}, check_bad),
    # Last in the file: the rows before it compile their grammars before the engine steps,
    # which would eat into its deadline before its first token.
    "deadline reached while running": (
        {"prompt": "Tell", "max_tokens": MAX_TOKENS, "ignore_eos": True, "timeout": TIMEOUT_S},
        check_timeout,
    ),
}  # fmt: skip
EXPECTED_EXTRA = {BAD_ROW: {"status": "failed", "error_code": "invalid_request"}}
CHECKS: dict[str, Check] = {cause: check for cause, (_, check) in CASES.items()}
CHECKS[ENGINE_LOST] = check_lost


def expected(cause: str) -> dict[str, Any]:
    if cause in EXPECTED_EXTRA:
        return EXPECTED_EXTRA[cause]
    (row,) = [r for r in published() if r["cause"] == cause]
    return row["batch"]


def write(path: Path, rows: list[dict[str, Any]]) -> Path:
    names = list(dict.fromkeys(k for row in rows for k in row))
    pq.write_table(pa.table({k: [row.get(k) for row in rows] for k in names}), path)
    return path


@pytest.fixture(scope="module")
def model(model_dirs) -> str:
    return str(model_dirs("llama"))


@pytest.fixture(scope="module")
def outputs(ray_session, model, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Output rows by cause: one greedy pipeline run, then the in-process engine-lost run."""
    from actors.executor import ExecutorError
    from serve_app.batch.engine import BatchEngine

    root = tmp_path_factory.mktemp("batch-outcomes")
    source = write(root / "in.parquet", [{"id": c, **row} for c, (row, _) in CASES.items()])
    # A slow model, not a slow machine: the deadline row cannot make its 1,000 tokens in
    # TIMEOUT_S however fast the CPU (it made them in under 0.5 s on a fast one).
    run_batch(
        source, root / "out", model=model, defaults=BatchDefaults(temperature=0),
        engine_options={"step_delay_s": STEP_DELAY_S},
    )  # fmt: skip
    rows = {r["id"]: r for r in pq.read_table(root / "out").to_pylist()}
    engine = BatchEngine(model, defaults=BatchDefaults(max_tokens=4, temperature=0))
    try:

        def lost(step: Any, masks: Any = None) -> None:
            raise ExecutorError("worker lost")

        engine.llm.engine.executor.execute = lost
        (rows[ENGINE_LOST],) = engine(pa.table({"id": [ENGINE_LOST], "prompt": ["Hi"]})).to_pylist()
    finally:
        engine.llm.shutdown()
    return rows


def test_every_batch_row_of_the_table_has_a_case():
    reachable = {r["cause"] for r in published() if r["batch"] is not None}
    assert reachable == (set(CASES) | {ENGINE_LOST}) - set(EXPECTED_EXTRA)


@pytest.mark.ray
@pytest.mark.parametrize("cause", list(CHECKS))
def test_each_outcome_row_in_a_batch(outputs, cause):
    row, want = outputs[cause], expected(cause)
    assert row["status"] == want["status"], row
    if "error_code" in want:
        assert row["error_code"] == want["error_code"], row
    # Only the engine's failure is transient: --resume runs it again, never the others.
    assert is_transient(row["status"], row["error_code"]) == (want.get("note") == "transient")
    CHECKS[cause](row)
    if row["status"] != "failed":
        assert row["error_code"] is None and row["completion_tokens"] == len(row["token_ids"])
