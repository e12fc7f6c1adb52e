"""The grammar compile pool: a runaway compile is killed at its timeout (counted from the start
of compilation, not the queue) and the pool recovers; a saturated pool answers `overloaded`,
never `invalid_grammar`; what xgrammar would not enforce exactly is refused."""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from serve_app.grammar.service import GrammarService
from serve_app.grammar.spec import GrammarError, GrammarSpec
from tests.support.grammar import accepts, compile_spec


@pytest.fixture
def tight(service, monkeypatch):
    """The session's service with a short timeout and queue wait; restored afterwards."""
    monkeypatch.setattr(service, "compile_timeout_s", 1.0)
    monkeypatch.setattr(service.pool, "timeout_s", 1.0)
    monkeypatch.setattr(service.pool, "max_queue_wait_s", 0.5)
    assert service.wait_ready()
    return service


def _compile_all(service: GrammarService, specs: list[GrammarSpec]) -> list[object]:
    async def run() -> list[object]:
        return await asyncio.gather(*(service.compile(s) for s in specs), return_exceptions=True)

    return asyncio.run(run())


def test_runaway_compile_is_killed_and_the_pool_recovers(tight, engine_cache, monkeypatch):
    killed_before = tight.stats()["workers_killed"]
    monkeypatch.setattr(tight, "compile_delay_s", 30.0)  # a compile that would run for 30 s
    started = time.monotonic()
    with pytest.raises(GrammarError, match=r"timed out after 1s") as caught:
        compile_spec(tight, "regex", "[0-9]{3}-runaway")
    assert caught.value.code == "invalid_grammar"  # it ran its whole timeout: the spec's fault
    assert time.monotonic() - started < 10  # not the 30 s the compile wanted
    assert tight.stats()["workers_killed"] == killed_before + 1
    monkeypatch.setattr(tight, "compile_delay_s", 0.0)
    # A fresh trivial schema is served at once by the replacement worker.
    started = time.monotonic()
    payload = compile_spec(tight, "json_schema", json.dumps({"type": "integer", "maximum": 7}))
    assert time.monotonic() - started < 2.0
    assert accepts(engine_cache, payload, "7") and not accepts(engine_cache, payload, "8")
    # The timed-out spec is remembered: a retry is refused without holding a worker again.
    started = time.monotonic()
    with pytest.raises(GrammarError, match="timed out"):
        compile_spec(tight, "regex", "[0-9]{3}-runaway")
    assert time.monotonic() - started < 0.5


def test_timeout_counts_from_the_start_of_compilation(tight, monkeypatch):
    # Two workers, four 0.6 s compiles: the last two queue ~0.6 s, then compile 0.6 s each;
    # 1.2 s from arrival is past the 1 s timeout, yet none of them is timed out.
    monkeypatch.setattr(tight.pool, "max_queue_wait_s", 5.0)
    monkeypatch.setattr(tight, "compile_delay_s", 0.6)
    results = _compile_all(tight, [GrammarSpec("regex", f"[a-c]{{{n}}}-queued") for n in range(4)])
    assert all(not isinstance(r, BaseException) for r in results), results


def test_saturated_pool_answers_overloaded_not_invalid_grammar(tight, monkeypatch):
    monkeypatch.setattr(tight.pool, "max_queue", 1)
    # Compiles longer than the queue wait (0.5 s) and well under the timeout (a loaded machine
    # may take tens of ms more than the delay): the specs are fine, the pool is full.
    monkeypatch.setattr(tight.pool, "timeout_s", 5.0)
    monkeypatch.setattr(tight, "compile_delay_s", 0.9)
    before = tight.stats()["overloaded"]
    specs = [GrammarSpec("regex", f"[d-f]{{{n}}}-busy") for n in range(5)]
    results = _compile_all(tight, specs)
    overloaded = [r for r in results if isinstance(r, GrammarError)]
    # Two compile, one waits in the queue (and is refused after 0.5 s of waiting), two more
    # find the queue full and are refused at once.
    assert len(overloaded) == 3, results
    assert all(e.code == "overloaded" and "overloaded" in e.reason for e in overloaded)
    assert tight.stats()["overloaded"] == before + 3
    monkeypatch.setattr(tight, "compile_delay_s", 0.0)
    # Refusals for overload are not remembered: the same spec compiles once there is room.
    refused = next(s for s, r in zip(specs, results, strict=True) if isinstance(r, GrammarError))
    assert compile_spec(tight, "regex", refused.spec).kind == "regex"


def test_a_crashed_worker_fails_its_grammar_and_is_replaced(tight, monkeypatch):
    monkeypatch.setattr(tight, "compile_delay_s", 0.8)

    async def crash_one() -> object:
        task = asyncio.ensure_future(tight.compile(GrammarSpec("regex", "[g-i]{2}-crash")))
        await asyncio.sleep(0.3)  # the worker is compiling it now
        busy = tight.pool.busy_pids()
        assert len(busy) == 1
        os.kill(busy[0], 9)
        return await asyncio.gather(task, return_exceptions=True)

    (result,) = asyncio.run(crash_one())
    assert isinstance(result, GrammarError) and "crashed" in result.reason
    monkeypatch.setattr(tight, "compile_delay_s", 0.0)
    assert compile_spec(tight, "regex", "[g-i]{3}-after").kind == "regex"


@pytest.mark.parametrize(
    ("kind", "spec", "reason"),
    [
        ("regex", "a^b", "not enforced exactly"),
        ("regex", "a$b", "not enforced exactly"),
        ("ebnf", 'root ::= "a" | "b"', None),
    ],
)
def test_what_xgrammar_would_widen_is_refused(service, kind, spec, reason):
    if reason is None:
        assert compile_spec(service, kind, spec).kind == kind
        return
    with pytest.raises(GrammarError, match=reason) as caught:
        compile_spec(service, kind, spec)
    assert caught.value.code == "invalid_grammar"


def test_close_ends_every_worker(model_path):
    svc = GrammarService(model_path, num_workers=1)
    assert svc.wait_ready()
    pids = svc.pool.worker_pids()
    svc.close()
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids and not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
