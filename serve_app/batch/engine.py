"""The Ray Data `map_batches` callable of `serve-app batch`: one engine per actor, and each
batch of rows run as one continuous batch (every valid row added, then stepped until done).

In a job (`commit` given) the actor commits its rows itself as they finish (batch_commit.py)
and returns only their number, so a killed job keeps what had finished; on the board's stop
it aborts the rows that have not produced a token, lets the others run until the drain
deadline, aborts what is left (no row: `--resume` runs it) and starts no further call.
Without `commit` a call returns its rows (the in-process tests use it so).

With tensor_parallel_size > 1 the engine's RayExecutor starts one worker actor per rank in a
placement group it creates (this actor is not in one), and removes it on shutdown."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from actors.deadlines import RequestRejected
from actors.executor import ExecutorError
from actors.grammar_cache import CompiledGrammarCache, load_tokenizer_info
from actors.llm import LLM
from actors.torch_thread import TorchThread, favour_step_thread
from serve_app import outcomes
from serve_app.batch.commit import CommitPlan, JobLink
from serve_app.batch.faults import FaultHook, KillPoint
from serve_app.batch.parquet_io import OUTPUT_SCHEMA
from serve_app.batch.rows import (
    BatchDefaults,
    RowError,
    check_prompt,
    grammar_spec,
    prompt_token_ids,
    row_timeout,
    sampling_params,
)
from serve_app.checkpoints.identity import artifact_identity
from serve_app.checkpoints.prompt_encoding import PromptEncoder
from serve_app.grammar.service import GrammarService
from serve_app.grammar.spec import GrammarError

logger = logging.getLogger(__name__)

IDENTITY_COLUMNS = ("model", "weights_sha256", "tokenizer_sha256", "chat_template_sha256")


@dataclass
class _Live:
    """A row whose request is in the engine."""

    index: int
    num_prompt_tokens: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)


class BatchEngine:
    def __init__(
        self,
        model: str,
        *,
        tensor_parallel_size: int = 1,
        defaults: BatchDefaults | None = None,
        num_threads: int = 1,
        model_name: str | None = None,
        engine_options: dict[str, Any] | None = None,
        commit: CommitPlan | None = None,
        board: Any = None,
        kills: tuple[KillPoint, ...] = (),
    ):
        import torch

        # Ray pins an actor to one OpenMP thread per CPU it asked for; with TP the ranks do
        # the model work in their own actors, each with its bundle's CPUs.
        torch.set_num_threads(max(1, num_threads))
        favour_step_thread()
        self.model = model
        self.tensor_parallel_size = tensor_parallel_size
        self.defaults = defaults or BatchDefaults()
        self.engine_options = dict(engine_options or {})
        # Loading and stepping on one thread (see actors/torch_thread.py).
        self._torch = TorchThread("batch-engine")
        self.llm = self._torch.run(self._build_llm)
        hashes = artifact_identity(model, self.llm.tokenizer.chat_template)
        # A rebuilt LLM loads the same tokenizer, so this outlives it.
        self._prompts = PromptEncoder(self.llm.tokenizer)
        self.identity = {
            "model": model_name or Path(model).resolve().name,
            **{k: hashes[k] for k in IDENTITY_COLUMNS[1:]},
        }
        # Built on the first row that asks for structured output.
        self._grammar: GrammarService | None = None
        self._grammar_cache = CompiledGrammarCache(lambda: load_tokenizer_info(model))
        self._faults = FaultHook(kills)
        self._job = JobLink(commit, board, self._faults) if commit is not None else None

    def _build_llm(self) -> LLM:
        tp = self.tensor_parallel_size
        return LLM(self.model, tensor_parallel_size=tp, **self.engine_options)

    # ------------------------------------------------------------------------ batch
    def __call__(self, batch: pa.Table) -> pa.Table:
        return self._torch.run(self._call, batch)

    def _call(self, batch: pa.Table) -> pa.Table:
        if self._job is not None and not self._job.begin_call():
            return _count(0)  # stopping: these rows stay for --resume
        self._faults.reached("call")
        if self.llm.engine.dead is not None:
            # A lost TP worker leaves the engine refusing work: start a fresh one.
            logger.warning("engine is down (%s); starting a new one", self.llm.engine.dead)
            self.llm.shutdown()
            self.llm = self._build_llm()
        rows = batch.to_pylist()
        results: list[dict[str, Any] | None] = [None] * len(rows)
        live: dict[str, _Live] = {}
        for i, row in enumerate(rows):
            request_id = f"row-{i}"
            try:
                ids, params, constraint = self._prepare(row)
                self.llm.engine.add_request(
                    request_id,
                    ids,
                    params,
                    constraints=[constraint] if constraint else None,
                    timeout_s=row_timeout(row),
                )
            except RowError as exc:
                self._done(results, i, self._failed(row, exc.code, exc.message))
            except RequestRejected as exc:  # a deadline the engine says cannot be met
                self._done(results, i, self._failed(row, exc.code, str(exc)))
            except ExecutorError as exc:
                self._done(results, i, self._failed(row, "engine_error", str(exc)))
            except ValueError as exc:  # the engine's own checks, e.g. a KV cache too small
                self._done(results, i, self._failed(row, "invalid_request", str(exc)))
            else:
                live[request_id] = _Live(i, len(ids))
        self._run(live, rows, results)
        if self._job is None:
            return pa.Table.from_pylist(results, schema=OUTPUT_SCHEMA)
        self._job.end_call()
        return _count(sum(r is not None for r in results))

    def _done(self, results: list[Any], index: int, row: dict[str, Any]) -> None:
        results[index] = row
        if self._job is not None:
            self._job.finished(row)

    def _prepare(self, row: dict[str, Any]) -> tuple[list[int], Any, Any]:
        config = self.llm.model_config
        ids = prompt_token_ids(row, self._prompts)
        check_prompt(ids, config.vocab_size, config.max_model_len)
        params = sampling_params(row, self.defaults, len(ids), config.max_model_len)
        spec = grammar_spec(row.get("response_format"))
        return ids, params, self._constraint(spec) if spec is not None else None

    def _constraint(self, spec: Any) -> Any:
        if self._grammar is None:
            self._grammar = GrammarService(self.model, max_threads=1, num_workers=1)
        if not self._grammar.available:
            raise RowError("unsupported_parameter", self._grammar.unavailable_reason)
        try:
            payload = asyncio.run(self._grammar.compile(spec))
            return self._grammar_cache.get_constraint(payload)
        except GrammarError as exc:
            raise RowError(exc.code, exc.reason) from None
        except ValueError as exc:
            raise RowError("invalid_grammar", str(exc)) from None

    def _run(self, live: dict[str, _Live], rows: list[dict[str, Any]], results: list[Any]) -> None:
        engine = self.llm.engine
        while live and engine.has_unfinished():
            if self._job is not None and self._job.tick() is not None:
                self._drain(live)
                if not live:
                    break
            try:
                outputs = engine.step()
            except Exception as exc:  # noqa: BLE001 (a broken step fails its rows, not the job)
                logger.exception("engine step failed")
                for state in live.values():
                    failed = self._failed(
                        rows[state.index], "engine_error", f"engine step failed: {exc}"
                    )
                    self._done(results, state.index, failed)
                engine.fail_all(f"engine step failed: {exc}")  # rebuilt on the next batch
                return
            for out in outputs:
                state = live.get(out.request_id)
                if state is None:
                    continue
                row = rows[state.index]
                if out.error is not None:
                    message = f"{out.error_code or 'error'}: {out.error}"
                    # A deadline that passed before the first token is the row's, not the
                    # engine's fault: not transient.
                    late = out.error_code == "deadline_unmeetable"
                    code = "deadline_unmeetable" if late else "engine_error"
                    self._done(results, state.index, self._failed(row, code, message, state))
                    del live[out.request_id]
                    continue
                finish_reason = None
                for delta in out.deltas:
                    state.text += delta.text
                    state.token_ids.extend(delta.token_ids)
                    if delta.finish_reason is not None:
                        finish_reason = delta.finish_reason.value
                if out.finished:
                    self._done(results, state.index, self._finished(row, state, finish_reason))
                    del live[out.request_id]
        while engine.has_unfinished() and not live:  # the aborted rows' last outputs
            engine.step()
        for state in live.values():  # not expected: the engine ran out of work early
            message = "the engine stopped before this row finished"
            failed = self._failed(rows[state.index], "engine_error", message, state)
            self._done(results, state.index, failed)

    def _drain(self, live: dict[str, _Live]) -> None:
        """The job is stopping: abort rows that have not started, and past the deadline all
        of them. An aborted row gets no result, so `--resume` runs it."""
        assert self._job is not None
        deadline = self._job.drain_deadline()
        is_late = deadline is not None and time.monotonic() >= deadline
        for request_id, state in list(live.items()):
            if is_late or not state.token_ids:
                self.llm.engine.abort(request_id)
                del live[request_id]

    # ----------------------------------------------------------------------- rows
    def _base(self, row: dict[str, Any], status: str) -> dict[str, Any]:
        return {"id": row["id"], "status": status, "attempt": row.get("_attempt") or 1,
                **self.identity}  # fmt: skip

    def _finished(self, row: dict[str, Any], state: _Live, reason: str | None) -> dict[str, Any]:
        if reason == "timeout":  # the row's deadline: failed, with the tokens it took
            message = f"the row's timeout passed after {len(state.token_ids)} output tokens"
            out = self._failed(row, "timeout", message, state)
            out.update(finish_reason="timeout", completion_tokens=len(state.token_ids))
            return out
        status = outcomes.batch_status(reason)
        out = self._base(row, status)
        out.update(
            text=state.text,
            token_ids=state.token_ids,
            finish_reason=reason,
            prompt_tokens=state.num_prompt_tokens,
            completion_tokens=len(state.token_ids),
        )
        if status == "failed":  # not expected: batch rows are never aborted
            out.update(error_code="engine_error", error_message=f"generation ended: {reason}")
        return out

    def _failed(
        self, row: dict[str, Any], code: str, message: str, state: _Live | None = None
    ) -> dict[str, Any]:
        out = self._base(row, "failed")
        out.update(
            error_code=code,
            error_message=message,
            finish_reason="error" if code == "engine_error" else None,
            prompt_tokens=state.num_prompt_tokens if state else None,
            completion_tokens=0,
        )
        return out

    def __del__(self) -> None:
        # Ray Data drops its pool's handles when the job ends, which runs this: the TP
        # workers and their placement group go with the engine.
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()
        if getattr(self, "_grammar", None) is not None:
            self._grammar.close()
        if getattr(self, "_torch", None) is not None:
            self._torch.shutdown()


def _count(num_rows: int) -> pa.Table:
    """What a committing call returns to Ray Data: its rows are already on disk."""
    return pa.table({"num_rows": pa.array([num_rows], pa.int64())})
