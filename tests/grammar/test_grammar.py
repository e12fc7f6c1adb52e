"""Grammar compilation service and its engine-side rebuild: kinds, cache, errors, timeouts,
the JSON Schema subset we claim, and constrained decoding end to end."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import json
import pickle
import re
from pathlib import Path

import jsonschema
import pytest
import xgrammar as xgr

from actors.grammar_cache import CompiledGrammarCache, load_tokenizer_info
from serve_app.grammar.service import SUPPORTED_JSON_SCHEMA, CompiledGrammarPayload, GrammarService
from serve_app.grammar.spec import GrammarError, GrammarSpec
from tests.support.grammar import accepts, compile_spec

# ------------------------------------------------------------------------- kinds and cache

_CHOICES = ["yes", 'say "hi"', "back\\slash", "naïve", "two\nlines"]
# fmt: off
KIND_CASES = {  # kind -> (spec, outputs it admits, outputs it refuses)
    "json_schema": (json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                "required": ["a"]}),
                    ['{"a": 12}'], ['{"a": "x"}', '{"a":12}', '{ "a": 12}', '{"a": 1, "b": 2}']),
    # Any object, compact; not a bare array or scalar, no free whitespace.
    "json_object": ("", ['{"k": [1, "x"]}', "{}"], ["[1, 2]", "3", '{ "k": 1}']),
    "regex": (r"(cat|dog)-[0-9]{2,4}", ["cat-12", "dog-1234"], ["cow-12", "cat-1"]),
    "ebnf": ('root ::= "a" root | "b"', ["b", "aab"], ["a", "bb"]),
    "choice": (json.dumps(_CHOICES), _CHOICES, ["ye", "yes!", "no"]),
}
# fmt: on


@pytest.mark.parametrize("kind", list(KIND_CASES))
def test_each_kind_compiles_to_a_grammar_that_constrains(service, engine_cache, kind):
    spec, good, bad = KIND_CASES[kind]
    payload = compile_spec(service, kind, spec)
    assert payload.kind == kind and len(payload.key) == 64
    assert all(accepts(engine_cache, payload, text) for text in good)
    assert not any(accepts(engine_cache, payload, text) for text in bad)


def test_second_compile_is_a_cache_hit_and_keyword_order_does_not_matter(service):
    x, y = {"type": "integer", "minimum": 0}, {"type": "boolean"}
    schema = {"type": "object", "properties": {"x": x, "y": y}, "required": ["x"]}
    before = service.stats()
    miss = compile_spec(service, "json_schema", json.dumps(schema))
    hit = compile_spec(service, "json_schema", json.dumps(schema))
    assert not miss.cache_hit and hit.cache_hit
    assert hit.key == miss.key and hit.serialized == miss.serialized
    # Keywords reordered at every level: the same schema, the same entry.
    shuffled = {"required": ["x"], "properties": {"x": dict(reversed(x.items())), "y": y},
                "type": "object"}  # fmt: skip
    same = compile_spec(service, "json_schema", json.dumps(shuffled, indent=2))
    assert same.cache_hit and same.key == miss.key
    # Property order is the order of the generated text, so it is a different grammar.
    swapped = dict(schema, properties={"y": y, "x": x})
    assert compile_spec(service, "json_schema", json.dumps(swapped)).key != miss.key
    after = service.stats()
    assert [after[k] - before[k] for k in ("cache_misses", "cache_hits", "compiles")] == [2, 2, 4]


@pytest.mark.parametrize("bound", [{"maxLength": 3}, {}])
def test_json_strings_admit_only_valid_json_and_utf8(service, engine_cache, bound):
    schema = {"type": ["string", "null"], **bound}
    payload = compile_spec(service, "json_schema", json.dumps(schema))
    assert all(accepts(engine_cache, payload, t) for t in ['"ab"', '"日本語"', '"é😀"', "null"])
    # Raw control characters (xgrammar 0.2.9's own bounded strings admit them: invalid JSON),
    # overlong UTF-8, and the UTF-8 form of a surrogate (xgrammar admits it in every string;
    # it detokenizes as three U+FFFD, longer than the bound the grammar counted).
    bad = [b'"a\x05"', b'"\t"', b'"\xf0\x83\xb2\xb1"', b'"\xe0\x80\xaf"', b'"\xed\xa0\x80"']
    bad += [b'"\xed\xbf\xbfx"', b'"abcd"'] if bound else [b'"a\xed\xb0\x80b"']
    assert not any(accepts(engine_cache, payload, raw) for raw in bad)
    assert accepts(engine_cache, payload, b'"\xed\x9f\xbf\xee\x80\x80"')  # U+D7FF, U+E000


def test_concurrent_requests_share_one_compilation(service, monkeypatch):
    monkeypatch.setattr(service, "compile_delay_s", 0.5)  # slow: every request finds it running
    before = service.stats()

    async def many() -> list[CompiledGrammarPayload]:
        spec = GrammarSpec("regex", "[a-z]{3}-shared")
        return await asyncio.gather(*(service.compile(spec) for _ in range(8)))

    payloads = asyncio.run(many())
    after = service.stats()
    assert [after[k] - before[k] for k in ("cache_misses", "inflight_joins")] == [1, 7]
    assert len({p.serialized for p in payloads}) == 1


def test_byte_bound_evicts_least_recently_used(model_path, service):
    patterns = ("[a-c]{4}", "[d-f]{5}", "[g-i]{6}")
    sizes = [len(compile_spec(service, "regex", p).serialized) for p in patterns]
    limit = sizes[0] + sizes[2] + 100  # room for two of the three
    small = GrammarService(model_path, cache_limit_bytes=limit)
    a, b, c = patterns
    try:
        compile_spec(small, "regex", a)
        compile_spec(small, "regex", b)
        assert compile_spec(small, "regex", a).cache_hit  # a is now the most recent
        compile_spec(small, "regex", c)  # evicts b, the least recently used
        stats = small.stats()
        assert stats["cache_entries"] == 2 and stats["cache_bytes"] == sizes[0] + sizes[2]
        assert compile_spec(small, "regex", a).cache_hit
        assert not compile_spec(small, "regex", b).cache_hit
    finally:
        small.close()


def test_injected_compile_delay_slows_misses_only(model_path):
    """`grammar.compile_delay_s`, the fault-injection knob of the overlap tests."""
    slow = GrammarService(model_path, compile_delay_s=0.3)
    try:
        miss = compile_spec(slow, "regex", "[x-z]{3}")
        hit = compile_spec(slow, "regex", "[x-z]{3}")
        assert not miss.cache_hit and miss.compile_seconds >= 0.3
        assert hit.cache_hit and hit.compile_seconds < 0.3
    finally:
        slow.close()
    with pytest.raises(ValueError, match="compile_delay_s"):
        GrammarService(model_path, compile_delay_s=-1)


# ------------------------------------------------------------------------------ errors

XGRAMMAR_LOG_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\]|\.cc\b")


@pytest.mark.parametrize(
    ("kind", "spec", "reason"),
    [
        ("regex", "[abc", "Regex parsing error at position 5: Unclosed '['"),
        ("json_schema", '{"type": "nonsense"}', "'nonsense' is not a JSON Schema type"),
        ("ebnf", 'root ::= "a" |', "EBNF parser error at line 1"),
        ("json_schema", "{not json", "JSON schema is not valid JSON"),
        ("json_schema", "[1, 2]", "must be an object or a boolean"),
        ("choice", "[]", "non-empty JSON list of strings"),
        ("choice", '["a", 1]', "non-empty JSON list of strings"),
        ("regex", "", "needs a non-empty spec"),
        ("xml", "<a/>", "unsupported grammar kind 'xml'"),
    ],
)
def test_invalid_grammar_has_a_clean_reason(service, kind, spec, reason):
    before = service.stats()["errors"]
    with pytest.raises(GrammarError) as caught:
        compile_spec(service, kind, spec)
    assert caught.value.code == "invalid_grammar"
    assert reason in caught.value.reason
    assert not XGRAMMAR_LOG_PREFIX.search(caught.value.reason), caught.value.reason
    assert service.stats()["errors"] == before + 1


def test_unusable_tokenizer_makes_the_service_unavailable(model_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("[05:08:17] /project/cpp/tokenizer_info.cc:12: unsupported vocab")

    monkeypatch.setattr(xgr.TokenizerInfo, "from_huggingface", refuse)
    svc = GrammarService(model_path)
    try:
        assert not svc.available and not svc.identity()["available"]
        assert svc.unavailable_reason.endswith(": unsupported vocab")
        with pytest.raises(GrammarError) as caught:
            compile_spec(svc, "regex", "a")
        assert caught.value.code == "grammar_unavailable"
    finally:
        svc.close()


def test_payload_and_error_survive_pickling(service):
    payload = compile_spec(service, "regex", "[xyz]{2}")
    assert pickle.loads(pickle.dumps(payload)) == payload
    error = pickle.loads(pickle.dumps(GrammarError(code="invalid_grammar", reason="bad")))
    assert (error.code, error.reason, str(error)) == ("invalid_grammar", "bad", "bad")


def test_identity_names_backend_and_tokenizer(service, model_path):
    identity = service.identity()
    assert identity["backend"] == "xgrammar"
    assert identity["backend_version"] == importlib.metadata.version("xgrammar")
    tokenizer_json = (Path(model_path) / "tokenizer.json").read_bytes()
    assert identity["tokenizer_hash"] == hashlib.sha256(tokenizer_json).hexdigest()
    assert identity["available"] and identity["supported_json_schema"] is SUPPORTED_JSON_SCHEMA


def test_engine_cache_rebuilds_once_and_gives_each_sample_its_own_matcher(service, model_path):
    cache = CompiledGrammarCache(load_tokenizer_info(model_path), max_entries=2)
    a, b, c = (compile_spec(service, "regex", pattern) for pattern in ("a+", "b+", "c+"))
    first, second = cache.get_constraint(a), cache.get_constraint(a)
    assert first.matcher.accept_string("aa") and first.matcher.is_completed()
    assert not second.matcher.is_completed()  # its own state, untouched by the first
    assert (cache.num_misses, cache.num_hits) == (1, 1)
    cache.get_constraint(b)
    cache.get_constraint(c)  # evicts a: at most two rebuilt grammars are kept
    cache.get_constraint(a)
    assert len(cache) == 2 and cache.num_misses == 4


def test_engine_cache_refuses_a_grammar_built_for_another_vocabulary(service, model_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    wider = CompiledGrammarCache(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=4096))
    with pytest.raises(ValueError, match="Vocab size mismatch"):
        wider.get_constraint(compile_spec(service, "regex", "a+"))


# ----------------------------------------------------------- constrained decoding end to end

_NAME = {"type": "string", "minLength": 1, "maxLength": 6}
_DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
# fmt: off
E2E_SCHEMAS = {
    "nested": {"type": "object", "required": ["name", "address"], "properties": {
        "name": _NAME,
        "address": {"type": "object", "required": ["city", "zip"], "properties": {
            "city": _NAME, "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}}}}},
    "bounded_array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                      "minItems": 1, "maxItems": 3},
    "enums_optional": {"type": "object", "required": ["color", "score"], "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "ok": {"type": "boolean"}, "note": {"type": "string", "maxLength": 4}}},
    "refs_anyof": {"$defs": {"pt": {"type": "object", "required": ["x", "y"],
                                    "properties": {"x": _DIGIT, "y": _DIGIT}}},
                   "type": "object", "required": ["points", "label"], "properties": {
                       "points": {"type": "array", "items": {"$ref": "#/$defs/pt"},
                                  "minItems": 1, "maxItems": 2},
                       "label": {"anyOf": [_NAME, {"type": "null"}]}}},
}
# fmt: on
E2E_REGEXES = [r"(cat|dog)-[0-9]{2,4}", r"[a-f]{3}\.[0-9]{1,2}"]
E2E_CHOICES = ["yes", "no", "maybe so"]
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def llm(model_path):
    from actors import LLM

    return LLM(model=model_path)


def _run_batch(llm, requests: dict[str, tuple[list, int, int]]) -> dict[str, list[list]]:
    """request id -> (constraints, seed, max_tokens), all in one batch; returns request id ->
    [text, finish reason] per sample."""
    from actors import SamplingParams

    prompt = llm.tokenizer.encode("output:")
    results: dict[str, list[list]] = {}
    for rid, (constraints, seed, max_tokens) in requests.items():
        params = SamplingParams(n=len(constraints), max_tokens=max_tokens, temperature=1, seed=seed)
        llm.engine.add_request(rid, prompt, params, constraints=constraints)
        results[rid] = [["", None] for _ in constraints]
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            for delta in out.deltas:
                sample = results[out.request_id][delta.index]
                sample[0] += delta.text
                sample[1] = delta.finish_reason or sample[1]
    return results


def _obeys(spec: GrammarSpec, text: str) -> bool:
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(spec.spec))
        return True
    if spec.kind == "regex":
        return re.fullmatch(spec.spec, text) is not None
    if spec.kind == "choice":
        return text in json.loads(spec.spec)
    return isinstance(json.loads(text), dict)


def test_constrained_generation_obeys_each_grammar(service, engine_cache, llm):
    specs = [GrammarSpec("json_schema", json.dumps(schema)) for schema in E2E_SCHEMAS.values()]
    specs += [GrammarSpec("regex", pattern) for pattern in E2E_REGEXES]
    specs += [GrammarSpec("choice", json.dumps(E2E_CHOICES)), GrammarSpec("json_object")]
    payloads = [asyncio.run(service.compile(spec)) for spec in specs]
    requests, spec_of = {}, {}
    for i, (spec, payload) in enumerate(zip(specs, payloads, strict=True)):
        # The batch lasts as long as its longest request; json_object has no bound of its own.
        max_tokens = 48 if spec.kind == "json_object" else 200
        for seed in SEEDS:
            requests[f"{i}/{seed}"] = ([engine_cache.get_constraint(payload)], seed, max_tokens)
            spec_of[f"{i}/{seed}"] = spec
    # n=3 samples of one request: each needs its own matcher.
    requests["n3"] = ([engine_cache.get_constraint(payloads[0]) for _ in range(3)], 7, 200)
    spec_of["n3"] = specs[0]
    for rid, samples in _run_batch(llm, requests).items():
        for text, reason in samples:
            if spec_of[rid].kind == "json_object" and reason == "length":
                assert text.startswith("{"), text  # a prefix the matcher accepted (see below)
                continue
            assert reason == "stop" and _obeys(spec_of[rid], text), (spec_of[rid], text, reason)
        if rid == "n3":
            assert len({text for text, _ in samples}) > 1
    assert all(c.num_rejected == 0 for cs, _, _ in requests.values() for c in cs)
