"""Run a selection of cases against one server into a record."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from serve_app.conformance.cases import Case, select
from serve_app.conformance.record import (
    SUITE_VERSION,
    CaseRecord,
    Failed,
    Record,
    Unsupported,
    Verdict,
)
from serve_app.conformance.session import Session, Target

# The served-identity facts a record carries from /v1/server_info; a change in one of them
# explains differences in text, token ids and logprobs (docs/conformance.md).
IDENTITY_KEYS = (
    "weights_sha256",
    "tokenizer_sha256",
    "chat_template_sha256",
    "gguf_sha256",
    "grammar_backend",
    "tool_parsers",
    "reasoning_parser",
)


def run_suite(
    target: Target,
    cases: list[Case] | None = None,
    progress: Callable[[CaseRecord], None] | None = None,
) -> Record:
    cases = select() if cases is None else cases
    session = Session(target)
    started = time.perf_counter()
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    try:
        server = identify(session)
        results = []
        for spec in cases:
            record = run_case(session, spec)
            results.append(record.as_dict())
            if progress is not None:
                progress(record)
    finally:
        session.close()
    return Record(
        server=server,
        cases=results,
        suite={"version": SUITE_VERSION, "cases": [c.id for c in cases]},
        started_at=started_at,
        duration_s=round(time.perf_counter() - started, 3),
    )


def run_case(session: Session, spec: Case) -> CaseRecord:
    record = CaseRecord(spec.id, spec.title)
    started = time.perf_counter()
    try:
        spec.run(session, record)
        record.finish()
    except Unsupported as exc:
        record.server_answer = exc.answer
        record.notes["unsupported"] = exc.reason
        # Clauses already broken stay broken: only an otherwise clean case is unsupported.
        record.verdict = Verdict.VIOLATION if record.violations else Verdict.UNSUPPORTED
    except Failed as exc:
        record.violations.append(str(exc))
        record.verdict = Verdict.VIOLATION
    except Exception as exc:  # the server broke the exchange itself (a reset, a bad body)
        record.violations.append(f"the case could not complete: {type(exc).__name__}: {exc}")
        record.verdict = Verdict.VIOLATION
    record.timings["total_s"] = round(time.perf_counter() - started, 4)
    return record


def identify(session: Session) -> dict[str, Any]:
    """Who is being tested: from /v1/server_info when present, else what can be observed."""
    info = session.server_info
    r = session.http.get("/v1/models")
    observed: dict[str, Any] = {
        "models": [m.get("id") for m in session.models],
        "server_header": r.headers.get("server"),
        "server_info": info is not None,
    }
    identity: dict[str, Any] = {}
    if info is not None:
        artifact = info.get("artifact") or {}
        grammar = info.get("grammar_backend") or {}
        tools = info.get("tool_calling") or {}
        identity = {
            "weights_sha256": artifact.get("weights_sha256"),
            "tokenizer_sha256": artifact.get("tokenizer_sha256"),
            "chat_template_sha256": artifact.get("chat_template_sha256"),
            "gguf_sha256": artifact.get("gguf_sha256"),
            "grammar_backend": _version(grammar.get("backend"), grammar.get("backend_version")),
            "tool_parsers": tools.get("parsers"),
            "reasoning_parser": tools.get("reasoning_parser"),
        }
        observed.update(
            fingerprint=artifact.get("fingerprint"),
            architecture=artifact.get("architecture"),
            dtype=artifact.get("dtype"),
            chat_template_source=artifact.get("chat_template_source"),
            max_model_len=session.max_model_len,
        )
    return {
        "base_url": session.target.root,
        "model": session.model,
        "identity": identity,
        "observed": observed,
    }


def _version(name: Any, version: Any) -> str | None:
    return None if name is None else f"{name} {version}" if version else str(name)
