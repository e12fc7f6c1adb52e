"""`serve-app batch` over Parquet: one output row per input id, bad rows fail alone, greedy text
matches the offline LLM at TP=1 and TP=2, structured rows validate, and resume neither loses
nor repeats work. The Ray tests share two pipeline runs (half at TP=1, then all with --resume at
TP=2) through a module fixture; input checks and the output bookkeeping need no Ray."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from serve_app.batch.job import BatchDefaults, BatchInputError, run_batch
from serve_app.batch.parquet_io import OUTPUT_SCHEMA, OutputDir, compact, scan_results
from serve_app.cli import main
from tests.support.fresh_python import run_python

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
OPENAI_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
FIRST_MAX_TOKENS = 16  # defaults of the first run
SECOND_MAX_TOKENS = 6  # defaults of the resumed run: kept rows must not change

# The first half: prompt rows, structured output, and rows that must fail alone.
PROMPT_ROWS = [
    {"id": "p-hello", "prompt": "Hello there"},
    {"id": "p-cat", "prompt": "The cat sat on", "max_tokens": 10},
    {"id": "p-stop", "prompt": "Once upon a time", "stop": ["e"]},
    {"id": "p-seeded", "prompt": "x = [1, 2", "temperature": 0.9, "seed": 7},
    {"id": "json-short", "prompt": "A person:", "max_tokens": 64,
     "response_format": json.dumps({"json_schema": SCHEMA})},
    {"id": "json-openai", "prompt": "Another:", "max_tokens": 64,
     "response_format": json.dumps(OPENAI_FORMAT)},
    {"id": "bad-missing", "prompt": None},
    {"id": "bad-long", "prompt": "word " * 3000},
    {"id": "bad-max", "prompt": "hi", "max_tokens": 5000},
    {"id": "bad-schema", "prompt": "hi", "response_format": json.dumps(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})},
    {"id": "bad-regex", "prompt": "hi", "response_format": json.dumps({"regex": "[a-"})},
    {"id": "bad-format", "prompt": "hi", "response_format": "{not json"},
]  # fmt: skip
# The second half: token-id and chat rows (other columns: the files' schemas differ).
TOKEN_ROWS = [
    {"id": "t-ids", "prompt_token_ids": [5, 6, 7, 8, 9]},
    {"id": "t-bad-vocab", "prompt_token_ids": [1, 10**6]},
    {"id": "m-user", "messages": [{"role": "user", "content": "hi"}]},
    {"id": "m-system", "messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Name a color."}]},
]  # fmt: skip
EXPECTED_FAILURES = {
    "bad-missing": "invalid_request",
    "bad-long": "context_length_exceeded",
    "bad-max": "max_tokens_exceeded",
    "bad-schema": "invalid_grammar",
    "bad-regex": "invalid_grammar",
    "bad-format": "invalid_request",
    "t-bad-vocab": "invalid_request",
}
TRANSIENT_ID = "p-cat"  # marked as an engine failure after the first run


def _write(path: Path, rows: list[dict]) -> Path:
    # from_pylist takes its columns from the first row alone: list them all.
    names = list(dict.fromkeys(k for row in rows for k in row))
    pq.write_table(pa.table({k: [row.get(k) for row in rows] for k in names}), path)
    return path


def _by_id(table: pa.Table) -> dict[str, dict]:
    rows = table.to_pylist()
    assert len(rows) == len({r["id"] for r in rows}), "one row per id"
    return {r["id"]: r for r in rows}


def _read(out: Path) -> dict[str, dict]:
    return _by_id(pq.read_table(out))


# ------------------------------------------------------------------ the shared two runs


@pytest.fixture(scope="module")
def model(model_dirs) -> str:
    return str(model_dirs("llama"))


@pytest.fixture(scope="module")
def job(ray_session, model, tmp_path_factory) -> dict:
    """Run the first half with the API (TP=1), mark one row as a transient failure and drop
    a truncated file beside the results (a killed job's leftovers), then run everything with
    the CLI (the input directory this time), --resume, --tp 2 and different defaults."""
    root = tmp_path_factory.mktemp("batch")
    (root / "in" / "more").mkdir(parents=True)
    first = _write(root / "in" / "prompts.parquet", PROMPT_ROWS)
    _write(root / "in" / "more" / "tokens.parquet", TOKEN_ROWS)
    (root / "in" / "_SUCCESS").write_text("")  # a writer's marker, not data
    out = root / "out"
    readers_before = _footer_readers_started()
    summary = run_batch(
        first, out, model=model, defaults=BatchDefaults(max_tokens=FIRST_MAX_TOKENS, temperature=0)
    )
    footer_readers = _footer_readers_started() - readers_before
    before = _read(out)
    files_before = {p.name for p in out.glob("*.parquet")}
    (path,) = [
        p for p in out.glob("*.parquet") if TRANSIENT_ID in pq.read_table(p)["id"].to_pylist()
    ]
    table = pq.read_table(path)
    marked = [
        {**r, "status": "failed", "error_code": "engine_error", "text": None}
        if r["id"] == TRANSIENT_ID
        else r
        for r in table.to_pylist()
    ]
    pq.write_table(pa.Table.from_pylist(marked, schema=OUTPUT_SCHEMA), path)
    (out / "cut-short.parquet").write_bytes(b"PAR1 truncated by a kill")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(
            ["batch", str(root / "in"), str(out), "--model", model, "--resume",
             "--tp", "2", "--temperature", "0", "--max-tokens", str(SECOND_MAX_TOKENS)]
        )  # fmt: skip
    assert code == 0
    return {
        "root": root, "out": out, "first_summary": summary, "before": before,
        "files_before": files_before, "after": _read(out), "footer_readers": footer_readers,
        "second_summary": printed.getvalue(),
    }  # fmt: skip


def _footer_readers_started() -> int:
    """Actors Ray Data's Parquet reader has started to read file footers (dead ones too)."""
    from ray._private import state

    return sum(a["ActorClassName"] == "FooterReader" for a in state.actors().values())


@pytest.mark.ray
def test_a_one_file_job_starts_one_footer_reader_not_a_pool_of_processes(job):
    # Each is a worker process: Ray Data's default pool of 32 cost a small job seconds.
    assert job["footer_readers"] <= 1


@pytest.mark.ray
def test_first_run_summary_counts_every_row(job):
    s = job["first_summary"]
    assert s.num_rows == s.num_run == len(PROMPT_ROWS)
    assert s.num_completed + s.num_incomplete + s.num_failed == len(PROMPT_ROWS)
    assert s.num_failed == sum(1 for r in PROMPT_ROWS if r["id"] in EXPECTED_FAILURES)
    assert s.completion_tokens > 0 and s.output_tokens_per_s > 0


@pytest.mark.ray
def test_one_row_per_input_id_with_statuses_and_identity(job, model):
    after = job["after"]
    assert set(after) == {r["id"] for r in PROMPT_ROWS + TOKEN_ROWS}
    for rid, row in after.items():
        assert row["model"] == Path(model).name and len(row["weights_sha256"]) == 64
        assert row["tokenizer_sha256"] and row["chat_template_sha256"]
        if rid in EXPECTED_FAILURES:
            assert row["status"] == "failed", row
            assert row["error_code"] == EXPECTED_FAILURES[rid] and row["error_message"]
            assert row["text"] is None and row["completion_tokens"] == 0
        else:
            expected = {"stop": "completed", "length": "incomplete"}[row["finish_reason"]]
            assert row["status"] == expected and row["error_code"] is None
            assert row["completion_tokens"] == len(row["token_ids"]) > 0
            assert row["prompt_tokens"] > 0
    assert "outside the vocabulary" in after["t-bad-vocab"]["error_message"]
    assert "nonsense" in after["bad-schema"]["error_message"]


@pytest.mark.ray
def test_text_matches_the_offline_llm_at_tp1_and_tp2(job, model):
    """Rows of the first run come from TP=1 engines, rows of the resumed run (the second half
    and the re-run transient failure) from TP=2: both must match the in-process TP=1 LLM."""
    from transformers import AutoTokenizer

    from actors import LLM, SamplingParams

    after = job["after"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    llm = LLM(model=model)
    try:
        for row in PROMPT_ROWS + TOKEN_ROWS:
            rid = row["id"]
            if rid in EXPECTED_FAILURES or rid.startswith("json"):
                continue
            first_half = row in PROMPT_ROWS and rid != TRANSIENT_ID
            params = SamplingParams(
                max_tokens=row.get("max_tokens")
                or (FIRST_MAX_TOKENS if first_half else SECOND_MAX_TOKENS),
                temperature=row.get("temperature", 0.0),
                seed=row.get("seed"),
                stop=tuple(row.get("stop") or ()),
            )
            if "messages" in row:
                text = tokenizer.apply_chat_template(
                    row["messages"], tokenize=False, add_generation_prompt=True
                )
                prompt = tokenizer.encode(text, add_special_tokens=False)
            else:
                prompt = row.get("prompt") or row["prompt_token_ids"]
            ref = llm.generate([prompt], params)[0]
            assert after[rid]["token_ids"] == ref.token_ids, rid
            assert after[rid]["text"] == ref.text, rid
            assert after[rid]["finish_reason"] == ref.finish_reason, rid
    finally:
        llm.shutdown()


@pytest.mark.ray
def test_structured_rows_validate(job):
    for rid in ("json-short", "json-openai"):
        row = job["after"][rid]
        assert row["status"] == "completed", row
        jsonschema.validate(json.loads(row["text"]), SCHEMA)


@pytest.mark.ray
def test_resume_keeps_final_rows_and_reruns_only_transient_failures(job):
    before, after, out = job["before"], job["after"], job["out"]
    for rid, old in before.items():
        if rid == TRANSIENT_ID:
            continue
        # Not generated again: same text although the defaults changed, first attempt.
        assert after[rid]["text"] == old["text"] and after[rid]["attempt"] == 1, rid
    rerun = after[TRANSIENT_ID]
    assert rerun["attempt"] == 2 and rerun["status"] in ("completed", "incomplete")
    rerun_rows = len(TOKEN_ROWS) + 1
    assert f"this run: {rerun_rows} rows generated" in job["second_summary"]
    assert f"{len(PROMPT_ROWS) - 1} kept from earlier runs" in job["second_summary"]
    # Compacted: one file, one row per id (the superseded attempt dropped).
    assert len(list(out.glob("[!._]*.parquet"))) == 1
    # The truncated file was moved aside, not read and not deleted.
    assert not (out / "cut-short.parquet").exists()
    assert len(list(out.glob(".unreadable-*cut-short.parquet"))) == 1


@pytest.mark.ray
def test_resume_of_a_finished_job_runs_nothing(job, model):
    inputs = [job["root"] / "in" / "prompts.parquet", job["root"] / "in" / "more"]
    summary = run_batch(inputs, job["out"], model=model, resume=True)
    assert summary.num_run == 0 and summary.num_kept == summary.num_rows
    assert _read(job["out"]) == job["after"]


# ------------------------------------------------------------ checks before any work


def test_duplicate_ids_are_refused_before_any_work(tmp_path, capsys):
    ids = ["x", "y", "x", "z", "z", "w"]
    inp = _write(tmp_path / "dup.parquet", [{"id": i, "prompt": "hi"} for i in ids])
    with pytest.raises(BatchInputError, match=r"duplicate ids.*'x'.*'z'"):
        run_batch(inp, tmp_path / "out", model=str(tmp_path))
    assert not (tmp_path / "out").exists()
    # The CLI says the same as a usage error.
    assert main(["batch", str(inp), str(tmp_path / "o2"), "--model", str(tmp_path)]) == 2
    assert "duplicate ids" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"prompt": "hi"}], "no 'id' column"),
        ([{"id": 1, "prompt": "hi"}], "'id' must be a string"),
        ([{"id": None, "prompt": "hi"}, {"id": "a", "prompt": "hi"}], "null id"),
        ([{"id": "a", "prompt": "hi", "n": 2}], "unsupported column"),
    ],
)
def test_bad_input_files_fail_with_a_clear_error(tmp_path, rows, message):
    inp = _write(tmp_path / "in.parquet", rows)
    with pytest.raises(BatchInputError, match=message):
        run_batch(inp, tmp_path / "out", model=str(tmp_path))


def test_results_without_resume_are_not_overwritten(tmp_path, model):
    inp = _write(tmp_path / "in.parquet", [{"id": "a", "prompt": "hi"}])
    out = tmp_path / "out"
    out.mkdir()
    row = {"id": "a", "status": "completed", "text": "x", "attempt": 1}
    pq.write_table(pa.Table.from_pylist([row], schema=OUTPUT_SCHEMA), out / "part.parquet")
    with pytest.raises(BatchInputError, match="--resume"):
        run_batch(inp, out, model=model)


# ------------------------------------------------------------- output bookkeeping


def _result_file(path: Path, rows: list[tuple[str, str, str | None, int]]) -> None:
    table = [
        {"id": i, "status": s, "error_code": c, "attempt": a, "text": f"{i}@{a}"}
        for i, s, c, a in rows
    ]
    pq.write_table(pa.Table.from_pylist(table, schema=OUTPUT_SCHEMA), path)


def test_compaction_keeps_the_latest_attempt_of_each_id(tmp_path):
    _result_file(
        tmp_path / "a.parquet", [("x", "failed", "engine_error", 1), ("y", "completed", None, 1)]
    )
    _result_file(tmp_path / "b.parquet", [("x", "completed", None, 2)])
    # A compaction killed after its rename leaves an identical copy: still one row per id.
    _result_file(tmp_path / "c.parquet", [("y", "completed", None, 1)])
    out = OutputDir.open(tmp_path)
    assert compact(out) == 2
    texts = {r["id"]: r["text"] for r in pq.read_table(tmp_path).to_pylist()}
    assert texts == {"x": "x@2", "y": "y@1"}
    assert not (tmp_path / "c.parquet").exists()
    assert compact(out) == 0 and set(scan_results(out)) == {"x", "y"}


def test_model_problems_fail_before_any_work(tmp_path, model):
    inp = _write(tmp_path / "in.parquet", [{"id": "a", "prompt": "hi"}])
    with pytest.raises(BatchInputError, match="no config.json"):
        run_batch(inp, tmp_path / "out", model=str(tmp_path))
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) does not divide"):
        run_batch(inp, tmp_path / "out", model=model, tp=3)
    assert not (tmp_path / "out").exists()


def test_the_driver_checks_the_model_and_plans_the_pool_without_importing_the_engine(model):
    """A job's driver process never pays for torch, xgrammar or transformers: the engine is
    imported in Ray Data's actors, which build it."""
    code = (
        "import sys\n"
        "from serve_app.batch.job import _check_model\n"
        "from serve_app.batch.pipeline import EngineActor\n"
        f"_check_model({model!r}, 1)\n"
        "print(sorted(m for m in ('torch', 'xgrammar', 'transformers') if m in sys.modules))\n"
    )
    assert run_python(code) == "[]"


# ----------------------------------------------------------- the engine callable


def test_an_engine_failure_fails_its_rows_as_transient_and_the_next_batch_recovers(
    model, monkeypatch
):
    from actors.executor import ExecutorError
    from serve_app.batch.engine import BatchEngine

    engine = BatchEngine(model, defaults=BatchDefaults(max_tokens=4, temperature=0))
    batch = pa.table({"id": ["a", "b", "c"], "prompt": ["Hello", None, "The cat"]})
    try:

        def lost(step, masks=None):
            raise ExecutorError("worker lost")

        monkeypatch.setattr(engine.llm.engine.executor, "execute", lost)
        rows = _by_id(engine(batch))
        assert rows["a"]["status"] == rows["c"]["status"] == "failed"
        assert (
            rows["a"]["error_code"] == "engine_error"
            and "worker lost" in rows["a"]["error_message"]
        )
        assert rows["b"]["error_code"] == "invalid_request"  # the bad row stays the row's fault
        rows = _by_id(engine(batch))  # a new engine is built for the next batch
        assert rows["a"]["status"] == "incomplete" and rows["a"]["completion_tokens"] == 4
    finally:
        engine.llm.shutdown()
