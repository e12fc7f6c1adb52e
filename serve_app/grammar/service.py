"""Grammar compilation: spec -> serialized xgrammar `CompiledGrammar`, cached (a plain class;
`app.py` makes it the Grammar deployment). Compiles run in worker processes
(`serve_app.grammar.compile_pool`) that are killed when they run past the timeout, so a
pathological grammar never holds the service; results are `serialize_json()` text because
`CompiledGrammar` cannot cross Ray (the engine rebuilds it: `actors.grammar_cache`).

Outcomes (docs/structured-output.md): a spec outside the enforced subset or the complexity
limits, or one that fails to compile, is `invalid_grammar` / `request_limit_exceeded`; a
compile that ran its whole timeout on a worker of its own is the spec's fault
(`invalid_grammar`, "timed out"); a compile that could not get a worker (queue full, or the
wait for one too long) is `overloaded` (503 with Retry-After), never the spec's fault."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.grammar_cache import load_tokenizer_info
from serve_app.checkpoints.identity import tokenizer_hash
from serve_app.grammar.compile_pool import (
    CompileCrashed,
    CompilePool,
    CompileRefused,
    CompileTimeout,
    PoolClosed,
    PoolJob,
    PoolSaturated,
)
from serve_app.grammar.compile_worker import CompileJob
from serve_app.grammar.schema_limits import SchemaLimits
from serve_app.grammar.schema_subset import SUPPORTED_JSON_SCHEMA
from serve_app.grammar.spec import (
    GRAMMAR_KINDS,
    STRUCTURAL_KINDS,
    GrammarError,
    GrammarSpec,
    check_spec,
    clean_reason,
)

logger = logging.getLogger(__name__)

BACKEND = "xgrammar"
BACKEND_VERSION = importlib.metadata.version("xgrammar")
DEFAULT_CACHE_LIMIT_BYTES = 64 << 20
# Part of the cache key: another backend, version or compile option must not hit old entries.
COMPILER_ID = (
    f"{BACKEND}=={BACKEND_VERSION};any_whitespace=0;strict_mode=1;bounded_char=json;stop=eos"
)
# Refusals remembered so a repeat is answered without a compile: bad specs for good, a
# timeout for a while (a machine that was overloaded then may compile it in time later).
MAX_REFUSALS = 1024
TIMEOUT_REFUSAL_TTL_S = 600.0
# Re-exported: the subset /v1/server_info lists.
__all__ = ["SUPPORTED_JSON_SCHEMA"]

_COUNTERS = (
    "compiles", "cache_hits", "cache_misses", "inflight_joins", "timeouts", "errors", "overloaded"
)  # fmt: skip
OnCompile = Callable[[str, float, bool, str], None]  # kind, seconds, hit, outcome
# outcome: ok | error | timeout | overloaded


@dataclass(frozen=True)
class CompiledGrammarPayload:
    """What crosses Ray to the engine: plain strings and numbers, so it pickles."""

    key: str  # sha256 hex of backend, version, tokenizer, kind and canonical spec
    serialized: str  # CompiledGrammar.serialize_json()
    kind: str
    compile_seconds: float  # how long this request waited (about 0 on a cache hit)
    cache_hit: bool


class _ByteBoundedLRU:
    """Serialized grammars by key, evicting least recently used past `limit_bytes`."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.num_bytes = 0
        self.entries: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str) -> str | None:
        if key in self.entries:
            self.entries.move_to_end(key)
        return self.entries.get(key)

    def put(self, key: str, value: str) -> None:
        size = len(value.encode())
        if key in self.entries or size > self.limit_bytes:
            return
        self.entries[key] = value
        self.num_bytes += size
        while self.num_bytes > self.limit_bytes:
            _, old = self.entries.popitem(last=False)
            self.num_bytes -= len(old.encode())


class GrammarService:
    def __init__(
        self,
        model_path: str,
        *,
        max_threads: int = 4,
        cache_limit_bytes: int = DEFAULT_CACHE_LIMIT_BYTES,
        compile_timeout_s: float = 10.0,
        on_compile: OnCompile | None = None,
        compile_delay_s: float = 0.0,
        num_workers: int = 2,
        max_queue: int = 8,
        max_queue_wait_s: float = 2.0,
        schema_limits: SchemaLimits | None = None,
        prestart: bool = True,
    ):
        """`max_threads`: xgrammar threads per compile worker; `num_workers` processes compile
        at once, `max_queue` more wait, none longer than `max_queue_wait_s` while all are busy.
        `prestart`: start the workers now (in the background) rather than at the first miss."""
        _check_options(max_threads, cache_limit_bytes, compile_timeout_s, compile_delay_s)
        path = Path(model_path)
        self.compile_timeout_s = compile_timeout_s
        # Fault injection for tests and benchmarks: every cache miss takes this much longer.
        self.compile_delay_s = compile_delay_s
        self.on_compile = on_compile
        self.schema_limits = schema_limits or SchemaLimits()
        self.tokenizer_hash = tokenizer_hash(path)
        self.vocab_size: int = json.loads((path / "config.json").read_text())["vocab_size"]
        self._tokenizer_info_json = ""
        self.unavailable_reason = ""
        try:
            # The engine's own tokenizer info: the same stop tokens on both sides.
            self._tokenizer_info_json = load_tokenizer_info(path).serialize_json()
        except Exception as exc:  # whatever xgrammar raises, the server chooses the policy
            self.unavailable_reason = f"xgrammar cannot use this tokenizer: {clean_reason(exc)}"
            logger.warning("grammar backend unavailable: %s", self.unavailable_reason)
        self._pool_options = dict(
            num_workers=num_workers,
            timeout_s=compile_timeout_s,
            max_queue=max_queue,
            max_queue_wait_s=max_queue_wait_s,
            threads_per_worker=max_threads,
        )
        self._pool: CompilePool | None = None
        self._lru = _ByteBoundedLRU(cache_limit_bytes)
        self._refusals: OrderedDict[str, tuple[str, float]] = OrderedDict()  # reason, until
        # One running compilation per key; concurrent requests for it wait on the same job.
        self._inflight: dict[str, PoolJob] = {}
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(_COUNTERS, 0)
        self._compile_seconds_total = 0.0
        if prestart and self.available:
            self._ensure_pool()

    @property
    def available(self) -> bool:
        return bool(self._tokenizer_info_json)

    @property
    def pool(self) -> CompilePool:
        """The compile workers (started on first use)."""
        return self._ensure_pool()

    async def compile(self, spec: GrammarSpec) -> CompiledGrammarPayload:
        started = time.perf_counter()
        try:
            kind, canonical = self._canonicalize(spec)
            key = self.cache_key(kind, canonical)
            serialized, pool_job = self._lookup(key, kind, canonical)
        except GrammarError as exc:
            known = spec.kind in GRAMMAR_KINDS + STRUCTURAL_KINDS
            label = spec.kind if known else "unknown"  # bounded labels
            self._record(label, started, hit=False, outcome=_outcome(exc))
            raise
        if serialized is not None:
            seconds = self._record(kind, started, hit=True, outcome="ok")
            return CompiledGrammarPayload(key, serialized, kind, seconds, cache_hit=True)
        assert pool_job is not None
        try:
            serialized = await self._wait(pool_job)
        except GrammarError as exc:
            self._record(kind, started, hit=False, outcome=_outcome(exc))
            raise
        seconds = self._record(kind, started, hit=False, outcome="ok")
        return CompiledGrammarPayload(key, serialized, kind, seconds, cache_hit=False)

    def wait_ready(self, timeout_s: float = 120.0) -> bool:
        """Block until every compile worker has started (benchmarks: time compiles, not
        start-up); False if they did not within `timeout_s`."""
        pool = self._ensure_pool()
        deadline = time.monotonic() + timeout_s
        while pool.stats()["workers_ready"] < self._pool_options["num_workers"]:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def cache_key(self, kind: str, canonical: str) -> str:
        parts = [COMPILER_ID, self.tokenizer_hash, self.vocab_size, kind, canonical]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def stats(self) -> dict[str, float]:
        pool = self._pool.stats() if self._pool is not None else {}
        with self._lock:
            cache = {"cache_bytes": self._lru.num_bytes, "cache_entries": len(self._lru.entries)}
            seconds = {"compile_seconds_total": self._compile_seconds_total}
            return {**self._stats, **cache, **seconds, **pool}

    def identity(self) -> dict[str, Any]:
        return {
            "backend": BACKEND,
            "backend_version": BACKEND_VERSION,
            "tokenizer_hash": self.tokenizer_hash,
            "vocab_size": self.vocab_size,
            "available": self.available,
            "unavailable_reason": self.unavailable_reason,
            "kinds": list(GRAMMAR_KINDS),
            "supported_json_schema": SUPPORTED_JSON_SCHEMA,
        }

    def close(self) -> None:
        # Kills the workers, a runaway compile included; queued requests are refused.
        if self._pool is not None:
            self._pool.close()

    def _ensure_pool(self) -> CompilePool:
        with self._lock:
            if self._pool is None:
                self._pool = CompilePool(self._tokenizer_info_json, **self._pool_options)
            return self._pool

    def _lookup(self, key: str, kind: str, canonical: str) -> tuple[str | None, PoolJob | None]:
        """The cached grammar, or the job that compiles it (joined or submitted)."""
        pool = self._ensure_pool()
        with self._lock:
            serialized = self._lru.get(key)
            if serialized is not None:
                self._stats["cache_hits"] += 1
                return serialized, None
            reason, until = self._refusals.get(key, ("", 0.0))
            if reason and time.monotonic() < until:
                raise GrammarError(reason)
            pool_job = self._inflight.get(key)
            if pool_job is not None:
                self._stats["inflight_joins"] += 1
                return None, pool_job
            try:
                pool_job = pool.submit(CompileJob(kind, canonical, self.compile_delay_s))
            except (PoolSaturated, PoolClosed) as exc:
                reason = f"grammar compilation is overloaded: {exc}"
                raise GrammarError(reason, "overloaded") from None
            self._stats["cache_misses"] += 1
            self._inflight[key] = pool_job
        pool_job.future.add_done_callback(lambda f: self._settle(key, pool_job))
        return None, pool_job

    def _settle(self, key: str, pool_job: PoolJob) -> None:
        """When a job ends: cache its grammar (or its refusal) and let the next request in.
        One critical section: no request finds the key in neither place and compiles again."""
        future = pool_job.future
        exc = future.exception()
        with self._lock:
            self._inflight.pop(key, None)
            if pool_job.started_at is not None:
                self._compile_seconds_total += time.monotonic() - pool_job.started_at
            if exc is None:
                self._lru.put(key, future.result())
            elif isinstance(exc, CompileRefused | CompileTimeout):  # the spec's own outcome
                ttl = TIMEOUT_REFUSAL_TTL_S if isinstance(exc, CompileTimeout) else float("inf")
                reason = _reason(exc, self.compile_timeout_s)
                self._refusals[key] = (reason, time.monotonic() + ttl)
                while len(self._refusals) > MAX_REFUSALS:
                    self._refusals.popitem(last=False)

    async def _wait(self, pool_job: PoolJob) -> str:
        """The job's grammar. A job still queued when the wait bound passes, while every
        worker is busy, is refused (overloaded); once started, the pool's timeout bounds it."""
        pool = self._pool
        assert pool is not None
        future = asyncio.wrap_future(pool_job.future)
        while not future.done():
            if pool_job.started_at is not None:
                await asyncio.wait({future})
                break
            await asyncio.wait({future}, timeout=pool.max_queue_wait_s)
            if not future.done():
                pool.expire(pool_job)
        exc = future.exception()
        if exc is None:
            return future.result()
        if isinstance(exc, PoolSaturated | PoolClosed):
            raise GrammarError(f"grammar compilation is overloaded: {exc}", "overloaded")
        raise GrammarError(_reason(exc, self.compile_timeout_s))

    def _canonicalize(self, spec: GrammarSpec) -> tuple[str, str]:
        """Validate the spec; return (kind, canonical text) — the cache key and what compiles.
        The text is canonical already (`GrammarSpec`); only the checks run here."""
        if spec.kind in GRAMMAR_KINDS and not self.available:
            raise GrammarError(self.unavailable_reason, code="grammar_unavailable")
        check_spec(spec, self.schema_limits)
        if spec.kind == "json_object":
            # Not the builtin JSON grammar: that admits top-level arrays and unbounded whitespace.
            return spec.kind, '{"type":"object"}'
        return spec.kind, spec.spec

    def _record(self, kind: str, started: float, *, hit: bool, outcome: str) -> float:
        seconds = time.perf_counter() - started
        with self._lock:
            self._stats["compiles"] += 1
            if outcome in ("timeout", "overloaded"):
                self._stats["timeouts" if outcome == "timeout" else "overloaded"] += 1
            elif outcome != "ok":
                self._stats["errors"] += 1
        if self.on_compile is not None:
            try:
                self.on_compile(kind, seconds, hit, outcome)
            except Exception:  # a metrics hook must never fail a request
                logger.exception("on_compile hook failed")
        return seconds


def _check_options(
    max_threads: int, cache_limit_bytes: int, compile_timeout_s: float, compile_delay_s: float
) -> None:
    if max_threads < 1:
        raise ValueError(f"max_threads must be >= 1, got {max_threads}")
    if cache_limit_bytes < 0:
        raise ValueError(f"cache_limit_bytes must be >= 0, got {cache_limit_bytes}")
    if not compile_timeout_s > 0:
        raise ValueError(f"compile_timeout_s must be > 0, got {compile_timeout_s}")
    if compile_delay_s < 0:
        raise ValueError(f"compile_delay_s must be >= 0, got {compile_delay_s}")


def _reason(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, CompileTimeout):
        return f"grammar compilation timed out after {timeout_s:g}s"
    if isinstance(exc, CompileCrashed | CompileRefused):
        return clean_reason(str(exc))
    return clean_reason(exc)


def _outcome(exc: GrammarError) -> str:
    if exc.code == "overloaded":
        return "overloaded"
    return "timeout" if "timed out" in exc.reason else "error"
