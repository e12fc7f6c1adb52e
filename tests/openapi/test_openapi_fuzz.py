"""The published contract, fuzzed: schemathesis generates requests for every public operation
from the live `/openapi.json` (positive and negative examples, a fixed seed) and every answer
must be no 5xx, conform to the documented schema, and carry a documented status code."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import httpx
import pytest
import requests

pytestmark = pytest.mark.serve

# Fixed so CI runs the same cases every time (hypothesis' @seed); change it to explore.
FUZZ_SEED = 19
# Per operation and mode: ~12 operations x 2 modes x this, bounded to ~a minute on 2 cores.
MAX_EXAMPLES = 15
# A generous per-request bound: a case that hangs is a failure, never a stuck test run.
REQUEST_TIMEOUT_S = 60
CHECK_NAMES = ("not_a_server_error", "response_schema_conformance", "status_code_conformance")
MAX_REPORTED = 12


def _checks() -> list[Any]:
    import schemathesis.checks

    return [getattr(schemathesis.checks, name) for name in CHECK_NAMES]


class Fuzz:
    """Runs cases, counts them, keeps what failed and what must be cleaned up after."""

    def __init__(self, checks: list[Any]) -> None:
        self.checks = checks
        self.session = requests.Session()
        self.counts: Counter[str] = Counter()
        self.statuses: dict[str, Counter[int]] = {}
        self.failures: list[str] = []
        self.generation_ids: set[str] = set()
        self.conversation_ids: set[str] = set()
        self.response_ids: set[str] = set()

    def run(self, case: Any, mode: str) -> None:
        from schemathesis.core.failures import FailureGroup

        label = f"{case.operation.label} [{mode}]"
        self.counts[label] += 1
        try:
            response = case.call(session=self.session, timeout=REQUEST_TIMEOUT_S)
        except requests.RequestException as exc:
            self.failures.append(f"{case.operation.label}: {type(exc).__name__}\n{_curl(case)}")
            return
        self.statuses.setdefault(label, Counter())[response.status_code] += 1
        self._remember(response)
        try:
            case.validate_response(response, checks=self.checks)
        except FailureGroup as exc:
            self.failures.append(f"{case.operation.label} -> {response.status_code}\n{exc}"[:1500])

    def _remember(self, response: Any) -> None:
        """Generations and conversations the cases created, to cancel and delete after."""
        if "application/json" not in response.headers.get("content-type", ""):
            location = response.headers.get("location", "")
            if "/v1/generations/" in location:
                self.generation_ids.add(location.rsplit("/", 1)[-1])
            return
        try:
            body = response.json()
        except ValueError:
            return
        if isinstance(body, dict) and isinstance(body.get("id"), str):
            if body.get("object") == "generation":
                self.generation_ids.add(body["id"])
            elif body.get("object") == "conversation":
                self.conversation_ids.add(body["id"])
            elif body.get("object") == "response":
                self.response_ids.add(body["id"])

    def clean_up(self, url: str) -> None:
        for gid in self.generation_ids:
            httpx.post(f"{url}/v1/generations/{gid}/cancel", timeout=30)
        for cid in self.conversation_ids:
            httpx.delete(f"{url}/v1/conversations/{cid}", timeout=30)
        for rid in self.response_ids:  # background ones may still run
            httpx.post(f"{url}/v1/responses/{rid}/cancel", timeout=30)


def _curl(case: Any) -> str:
    try:
        return case.as_curl_command()[:800]
    except Exception:  # noqa: BLE001 (only for the report)
        return "(no curl)"


def _fuzz_operation(fuzz: Fuzz, operation: Any, mode: Any) -> None:
    from hypothesis import HealthCheck, Phase, given, seed, settings

    @seed(FUZZ_SEED)
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def each(case: Any) -> None:
        fuzz.run(case, mode.value)

    each()


def _modes(operation: Any) -> list[Any]:
    """Positive always; negative where a value can violate its schema: a body or a header
    (any string is a valid id in a path, so a path alone has no negative examples)."""
    from schemathesis import GenerationMode

    if len(list(operation.body)) > 0 or len(list(operation.headers)) > 0:
        return [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    return [GenerationMode.POSITIVE]


def _wait_idle(admin_url: str, within_s: float) -> dict[str, int]:
    deadline = time.monotonic() + within_s
    while True:
        total = httpx.get(f"{admin_url}/admin/v1/stats", timeout=10).json()["total"]
        busy = {k: total[k] for k in ("kv_blocks_used", "live_requests", "running", "waiting")}
        if not any(busy.values()) or time.monotonic() > deadline:
            return busy
        time.sleep(0.1)


def test_every_public_operation_fuzzed_finds_no_5xx_and_conforms(serve_url, admin_url):
    import schemathesis

    document = httpx.get(f"{serve_url}/openapi.json", timeout=30).json()
    documented = {f"{m.upper()} {path}" for path, item in document["paths"].items() for m in item}
    schema = schemathesis.openapi.from_url(f"{serve_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    # schemathesis leaves out the operation that served the schema (fetched above).
    assert {op.label for op in operations} == documented - {"GET /openapi.json"}
    fuzz = Fuzz(_checks())
    started = time.monotonic()
    try:
        for operation in operations:
            for mode in _modes(operation):
                _fuzz_operation(fuzz, operation, mode)
    finally:
        fuzz.clean_up(serve_url)
    total = sum(fuzz.counts.values())
    print(
        f"\nschemathesis: {total} generated cases over {len(operations)} operations "
        f"(seed {FUZZ_SEED}, {MAX_EXAMPLES} per operation and mode, "
        f"{time.monotonic() - started:.0f} s), {len(fuzz.failures)} failed"
    )
    for label, count in sorted(fuzz.counts.items()):
        statuses = " ".join(f"{s}x{n}" for s, n in sorted(fuzz.statuses.get(label, {}).items()))
        print(f"  {count:4d}  {label}  {statuses}")
    for failure in fuzz.failures:
        print("FAILED:", " | ".join(line for line in failure.splitlines()[:3] if line))
    assert all(fuzz.counts[f"{op.label} [positive]"] for op in operations)
    # Nothing the cases started is left holding the engine.
    busy = _wait_idle(admin_url, 30)
    shown = "\n\n".join(fuzz.failures[:MAX_REPORTED])
    assert not fuzz.failures, f"{len(fuzz.failures)} of {total} cases failed:\n\n{shown}"
    assert not any(busy.values()), busy
