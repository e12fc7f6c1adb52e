"""Grammar compilation: spec -> serialized xgrammar `CompiledGrammar`, cached (a plain class;
`app.py` makes it the Grammar deployment). Compiles run on a thread pool behind a timeout, so a
pathological grammar never stalls the replica; results are `serialize_json()` text because
`CompiledGrammar` cannot cross Ray (the engine rebuilds it: `actors.grammar_cache`)."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xgrammar as xgr

from actors.grammar_cache import load_tokenizer_info
from serve_app.identity import tokenizer_hash
from serve_app.protocol.json_schema import schema_json

logger = logging.getLogger(__name__)

BACKEND = "xgrammar"
BACKEND_VERSION = importlib.metadata.version("xgrammar")
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf", "choice")
DEFAULT_CACHE_LIMIT_BYTES = 64 << 20
# Part of the cache key: another backend, version or compile option must not hit old entries.
COMPILER_ID = (
    f"{BACKEND}=={BACKEND_VERSION};any_whitespace=0;strict_mode=1;bounded_char=json;stop=eos"
)
MAX_REASON_CHARS = 500
# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:NN: ".
_LOG_PREFIX = re.compile(r"\[\d{1,2}:\d{2}:\d{2}\]\s+\S+?:\d+:\s*")
# NOTE: xgrammar 0.2.9 lets raw control characters into length-bounded JSON strings (invalid
# JSON). Its printed EBNF is patched to the character class its other JSON strings use.
_BOUNDED_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"

_COUNTERS = ("compiles", "cache_hits", "cache_misses", "inflight_joins", "timeouts", "errors")
OnCompile = Callable[[str, float, bool, str], None]  # kind, seconds, hit, ok|error|timeout


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    spec: str = ""


@dataclass(frozen=True)
class CompiledGrammarPayload:
    """What crosses Ray to the engine: plain strings and numbers, so it pickles."""

    key: str  # sha256 hex of backend, version, tokenizer, kind and canonical spec
    serialized: str  # CompiledGrammar.serialize_json()
    kind: str
    compile_seconds: float  # how long this request waited (about 0 on a cache hit)
    cache_hit: bool


class GrammarError(Exception):
    """A grammar the service will not compile; `code` is the API error code."""

    def __init__(self, reason: str, code: str = "invalid_grammar"):
        super().__init__(reason)
        self.reason = reason
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray: keep both fields
        return (type(self), (self.reason, self.code))


def clean_reason(exc: BaseException) -> str:
    text = " ".join(_LOG_PREFIX.sub("", str(exc)).split())
    return text[:MAX_REASON_CHARS] or type(exc).__name__


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
    ):
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        if cache_limit_bytes < 0:
            raise ValueError(f"cache_limit_bytes must be >= 0, got {cache_limit_bytes}")
        if not compile_timeout_s > 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {compile_timeout_s}")
        if compile_delay_s < 0:
            raise ValueError(f"compile_delay_s must be >= 0, got {compile_delay_s}")
        path = Path(model_path)
        self.compile_timeout_s = compile_timeout_s
        # Fault injection for tests and benchmarks: every cache miss takes this much longer.
        self.compile_delay_s = compile_delay_s
        self.on_compile = on_compile
        self.tokenizer_hash = tokenizer_hash(path)
        self.vocab_size: int = json.loads((path / "config.json").read_text())["vocab_size"]
        self._compiler: xgr.GrammarCompiler | None = None
        self.unavailable_reason = ""
        try:
            # The engine's own tokenizer info: the same stop tokens on both sides.
            info = load_tokenizer_info(path)
            self._compiler = xgr.GrammarCompiler(
                info, max_threads=max_threads, cache_limit_bytes=cache_limit_bytes
            )
        except Exception as exc:  # whatever xgrammar raises, the server chooses the policy
            self.unavailable_reason = f"xgrammar cannot use this tokenizer: {clean_reason(exc)}"
            logger.warning("grammar backend unavailable: %s", self.unavailable_reason)
        self._pool = ThreadPoolExecutor(max_threads, thread_name_prefix="grammar-compile")
        self._lru = _ByteBoundedLRU(cache_limit_bytes)
        # One running compilation per key; concurrent requests for it wait on the same future.
        self._inflight: dict[str, Future[str]] = {}
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(_COUNTERS, 0)
        self._compile_seconds_total = 0.0

    @property
    def available(self) -> bool:
        return self._compiler is not None

    async def compile(self, spec: GrammarSpec) -> CompiledGrammarPayload:
        started = time.perf_counter()
        try:
            kind, canonical = self._canonicalize(spec)
        except GrammarError:
            label = spec.kind if spec.kind in GRAMMAR_KINDS else "unknown"  # bounded labels
            self._record(label, started, hit=False, outcome="error")
            raise
        key = self.cache_key(kind, canonical)
        with self._lock:
            serialized = self._lru.get(key)
            if serialized is not None:
                self._stats["cache_hits"] += 1
            else:
                future = self._inflight.get(key)
                if future is not None:
                    self._stats["inflight_joins"] += 1
                else:
                    self._stats["cache_misses"] += 1
                    future = self._pool.submit(self._compile_and_store, key, kind, canonical)
                    self._inflight[key] = future
        if serialized is not None:
            seconds = self._record(kind, started, hit=True, outcome="ok")
            return CompiledGrammarPayload(key, serialized, kind, seconds, cache_hit=True)
        try:
            # shield: one waiter's timeout must not cancel a compilation others wait on.
            serialized = await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(future)), self.compile_timeout_s
            )
        except TimeoutError:
            self._record(kind, started, hit=False, outcome="timeout")
            reason = f"grammar compilation timed out after {self.compile_timeout_s:g}s"
            raise GrammarError(reason) from None
        except Exception:  # GrammarError, or an internal error that still counts
            self._record(kind, started, hit=False, outcome="error")
            raise
        seconds = self._record(kind, started, hit=False, outcome="ok")
        return CompiledGrammarPayload(key, serialized, kind, seconds, cache_hit=False)

    def cache_key(self, kind: str, canonical: str) -> str:
        parts = [COMPILER_ID, self.tokenizer_hash, self.vocab_size, kind, canonical]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    def stats(self) -> dict[str, float]:
        with self._lock:
            cache = {"cache_bytes": self._lru.num_bytes, "cache_entries": len(self._lru.entries)}
            return {**self._stats, **cache, "compile_seconds_total": self._compile_seconds_total}

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
        # A timed-out compilation may still run; never wait for it.
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _canonicalize(self, spec: GrammarSpec) -> tuple[str, str]:
        """Validate the spec; return (kind, canonical text) — the cache key and what compiles."""
        kind = spec.kind
        if kind not in GRAMMAR_KINDS:
            names = ", ".join(GRAMMAR_KINDS)
            raise GrammarError(f"unsupported grammar kind {kind!r}; expected one of {names}")
        if self._compiler is None:
            raise GrammarError(self.unavailable_reason, code="grammar_unavailable")
        if kind == "json_object":
            # Not the builtin JSON grammar: that admits top-level arrays and unbounded whitespace.
            return kind, '{"type":"object"}'
        if not isinstance(spec.spec, str) or not spec.spec:
            raise GrammarError(f"a {kind} grammar needs a non-empty spec")
        if kind == "json_schema":
            return kind, canonical_json_schema(spec.spec)
        if kind == "choice":
            return kind, _canonical_choices(spec.spec)
        return kind, spec.spec

    def _compile_and_store(self, key: str, kind: str, canonical: str) -> str:
        """On the pool. Stores the result even after every waiter timed out: a retry finds it."""
        started = time.perf_counter()
        serialized: str | None = None
        try:
            if self.compile_delay_s:
                time.sleep(self.compile_delay_s)  # on the pool thread, as a slow compile would
            serialized = self._compile_serialized(kind, canonical)
            return serialized
        except (RuntimeError, ValueError) as exc:
            raise GrammarError(clean_reason(exc)) from None
        finally:
            # One critical section: no request finds the key in neither place and compiles again.
            with self._lock:
                self._inflight.pop(key, None)
                self._compile_seconds_total += time.perf_counter() - started
                if serialized is not None:
                    self._lru.put(key, serialized)

    def _compile_serialized(self, kind: str, canonical: str) -> str:
        compiler = self._compiler
        assert compiler is not None
        if kind in ("json_schema", "json_object"):
            # No free whitespace: a weak model could otherwise emit it until max_tokens.
            # json_object is not strict: it admits any properties.
            options = {"any_whitespace": False, "strict_mode": kind == "json_schema"}
            ebnf = str(xgr.Grammar.from_json_schema(canonical, **options))
            compiled = compiler.compile_grammar(ebnf.replace(_BOUNDED_CHAR, _JSON_STRING_CHAR))
        elif kind == "regex":
            compiled = compiler.compile_regex(canonical)
        elif kind == "ebnf":
            compiled = compiler.compile_grammar(canonical)
        else:  # choice: JSON string escapes are valid EBNF string-literal escapes in xgrammar
            ebnf = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(canonical))
            compiled = compiler.compile_grammar(f"root ::= {ebnf}")
        return compiled.serialize_json()

    def _record(self, kind: str, started: float, *, hit: bool, outcome: str) -> float:
        seconds = time.perf_counter() - started
        with self._lock:
            self._stats["compiles"] += 1
            if outcome != "ok":
                self._stats["timeouts" if outcome == "timeout" else "errors"] += 1
        if self.on_compile is not None:
            try:
                self.on_compile(kind, seconds, hit, outcome)
            except Exception:  # a metrics hook must never fail a request
                logger.exception("on_compile hook failed")
        return seconds


def _canonical_choices(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"choice spec is not valid JSON: {exc}") from None
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
        raise GrammarError("choice spec must be a non-empty JSON list of strings")
    # Alternation order and duplicates do not change the language.
    return json.dumps(sorted(set(choices)), ensure_ascii=False)


# ---------------------------------------------------------------------- JSON Schema
# What xgrammar 0.2.9 enforces with the options used here; tests/test_grammar.py holds an
# accept/reject case for every keyword listed, so this list cannot claim more than it does.
# fmt: off
SUPPORTED_JSON_SCHEMA: dict[str, Any] = {
    "types": ["object", "array", "string", "integer", "number", "boolean", "null"],
    "keywords": [
        "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
        "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
        "minProperties", "maxProperties", "items", "prefixItems", "minItems", "maxItems",
        "minLength", "maxLength", "pattern", "format",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    ],
    "notes": {
        "enum": "any JSON values; objects and arrays are emitted compactly",
        "const": "any JSON value; objects and arrays are emitted compactly",
        "oneOf": "as anyOf: exclusivity is not enforced",
        "allOf": "a single subschema only",
        "$ref": "local (#/$defs/..., #/definitions/...), recursion allowed",
        "properties": "emitted in the declared order",
        "required": "names must also appear in properties",
        "additionalProperties": "false (the default here: strict mode), true or a schema",
        "patternProperties": "patterns match the whole property name",
        "minLength": "and maxLength: not with pattern or format; no escapes in such strings",
        "pattern": "matches the whole string, as if anchored",
        "multipleOf": "integers only",
    },
    "formats": [
        "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
        "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
    ],
    # Accepted in a schema but not enforced on the output: validate afterwards if they matter.
    "not_enforced": [
        "not", "if/then/else", "allOf with several subschemas", "uniqueItems", "contains",
        "dependentRequired", "dependentSchemas", "unlisted formats",
    ],
    "output": "no whitespace beyond ', ' and ': ' separators; unlisted properties rejected",
}

# fmt: on


def canonical_json_schema(spec: str) -> str:
    """Keyword order normalised, so equal schemas share a cache entry. Property order and the
    key order inside enum/const values are kept: they are the order of the generated text."""
    try:
        schema = json.loads(spec)
        if not isinstance(schema, dict | bool):
            raise GrammarError("a JSON schema must be an object or a boolean")
        return schema_json(schema)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"JSON schema is not valid JSON: {exc}") from None
    except RecursionError:
        raise GrammarError("JSON schema nests too deeply") from None
