"""The case registry and the requests every case makes: through the official `openai` client
for plain answers, raw HTTP for streams and refusals (where the client would hide the event
order, the headers or a body it cannot parse)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from serve_app.conformance.observe import error_facts, shape, union_shape
from serve_app.conformance.record import CaseRecord
from serve_app.conformance.session import Session, Stream

CaseFn = Callable[[Session, CaseRecord], None]


@dataclass(frozen=True)
class Case:
    id: str
    title: str
    run: CaseFn
    # In the fast subset (`--fast`, `make test`): seconds on a tiny checkpoint.
    fast: bool


REGISTRY: list[Case] = []


def case(case_id: str, title: str, *, fast: bool = True) -> Callable[[CaseFn], CaseFn]:
    def register(fn: CaseFn) -> CaseFn:
        if any(c.id == case_id for c in REGISTRY):
            raise ValueError(f"two cases named {case_id!r}")
        REGISTRY.append(Case(case_id, title, fn, fast))
        return fn

    return register


# Statuses that say "not this feature here" for a request the suite knows to be valid.
REFUSED_AS_UNSUPPORTED = (400, 404, 405, 422, 501)

CHAT_PARAMS = {
    "max_tokens", "temperature", "top_p", "n", "stop", "logprobs", "top_logprobs", "seed",
    "response_format", "tools", "tool_choice", "parallel_tool_calls", "stream_options",
}  # fmt: skip
COMPLETION_PARAMS = {
    "max_tokens", "temperature", "top_p", "n", "stop", "logprobs", "echo", "seed",
    "stream_options",
}  # fmt: skip


def refused(record: CaseRecord, what: str, status: int, headers: dict, body: Any) -> NoReturn:
    """A refusal of a request the suite knows to be valid: `unsupported` when the server says
    it does not take it (4xx), else a violation that ends the case."""
    record.outputs.setdefault("refusals", {})[what] = error_facts(status, headers, body)
    if status in REFUSED_AS_UNSUPPORTED:
        record.unsupported(f"{what}: HTTP {status}", body)
    record.fail(f"{what}: HTTP {status}: {json.dumps(body)[:300]}")


def sdk_create(s: Session, record: CaseRecord, label: str, body: dict[str, Any]) -> dict:
    """A non-streamed chat or completions request through the official client; the raw JSON.

    Parameters the client knows go as its arguments, extensions as `extra_body`."""
    import openai

    record.inputs[label] = body
    chat = "messages" in body
    known = CHAT_PARAMS if chat else COMPLETION_PARAMS
    fixed = {"model", "messages"} if chat else {"model", "prompt"}
    kwargs = {k: v for k, v in body.items() if k in known or k in fixed}
    extra = {k: v for k, v in body.items() if k not in kwargs}
    resource = s.openai.chat.completions if chat else s.openai.completions
    try:
        raw = resource.with_raw_response.create(**kwargs, extra_body=extra or None)
    except openai.APIStatusError as exc:
        refused(record, label, exc.status_code, dict(exc.response.headers), _body(exc.response))
    raw.parse()  # the client's own models accept the answer
    data = json.loads(raw.text)
    record.outputs.setdefault("shape", {})[label] = shape(data)
    return data


def sdk_stream(s: Session, record: CaseRecord, label: str, body: dict[str, Any]) -> list[dict]:
    """A streamed chat request through the official client: its chunks, as JSON."""
    import openai

    record.inputs[label] = {**body, "stream": True}
    kwargs = {k: v for k, v in body.items() if k in CHAT_PARAMS or k in ("model", "messages")}
    extra = {k: v for k, v in body.items() if k not in kwargs}
    try:
        chunks = s.openai.chat.completions.create(**kwargs, stream=True, extra_body=extra or None)
        return [c.model_dump(mode="json", exclude_unset=True) for c in chunks]
    except openai.APIStatusError as exc:
        refused(record, label, exc.status_code, dict(exc.response.headers), _body(exc.response))


def raw_stream(
    s: Session,
    record: CaseRecord,
    label: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> Stream:
    body = {**body, "stream": True}
    record.inputs[label] = body
    stream = s.stream(path, body, headers)
    if stream.status != 200:
        refused(record, label, stream.status, stream.headers, stream.body)
    record.timings[f"{label}_ttft_s"] = round(stream.ttft_s or 0.0, 4)
    record.outputs.setdefault("shape", {})[label] = union_shape(stream.chunks)
    return stream


def raw_post(
    s: Session,
    record: CaseRecord,
    label: str,
    path: str,
    body: Any,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], Any]:
    """A request whose answer is recorded whatever it is (the error cases)."""
    record.inputs[label] = body if not isinstance(body, bytes) else body[:200].decode("latin-1")
    r = s.post(path, body, headers)
    return r.status_code, dict(r.headers), _body(r)


def json_object(response) -> dict[str, Any]:
    """A response's JSON as an object: a non-object under `value`, a non-JSON body's start
    under `text`."""
    try:
        value = response.json()
    except ValueError:
        return {"text": response.text[:500]}
    return value if isinstance(value, dict) else {"value": value}


def _body(response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text[:2000]


# ------------------------------------------------------------------ request bodies


def chat_body(s: Session, content: str, **fields: Any) -> dict[str, Any]:
    return {"model": s.model, "messages": [{"role": "user", "content": content}], **fields}


def completion_body(s: Session, prompt: str, **fields: Any) -> dict[str, Any]:
    return {"model": s.model, "prompt": prompt, **fields}


def with_token_ids(s: Session, body: dict[str, Any]) -> dict[str, Any]:
    """`body` asking for token ids (`return_token_ids`) where the server takes it."""
    return {**body, "return_token_ids": True} if returns_token_ids(s) else body


def returns_token_ids(s: Session) -> bool:
    """Whether the server takes `return_token_ids` and answers with ids (probed once)."""
    if "token_ids" not in s.cache:
        body = completion_body(s, "a", max_tokens=1, temperature=0, return_token_ids=True)
        r = s.post("/v1/completions", body)
        ok = r.status_code == 200 and r.json()["choices"][0].get("token_ids") is not None
        s.cache["token_ids"] = ok
    return s.cache["token_ids"]


def accepts(s: Session, field: str, value: Any) -> bool:
    """Whether the server takes an extension field (a 200 to a one-token request; probed once)."""
    key = f"accepts:{field}"
    if key not in s.cache:
        body = completion_body(s, "a", max_tokens=1, temperature=0, **{field: value})
        s.cache[key] = s.post("/v1/completions", body).status_code == 200
    return s.cache[key]


def long_output(s: Session, body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """`body` asking for `max_tokens` tokens, past the end token where the server allows it."""
    body = {**body, "max_tokens": max_tokens}
    return {**body, "ignore_eos": True} if accepts(s, "ignore_eos", True) else body


def reference_completion(s: Session, record: CaseRecord) -> dict[str, Any]:
    """The greedy completion the stop cases cut: text, token ids and per-token texts."""
    if "reference" not in s.cache:
        body = completion_body(
            s, REFERENCE_PROMPT, max_tokens=REFERENCE_TOKENS, temperature=0, logprobs=1
        )
        data = sdk_create(s, record, "reference", with_token_ids(s, body))
        choice = data["choices"][0]
        s.cache["reference"] = {
            "text": choice["text"],
            "token_ids": choice.get("token_ids"),
            "tokens": (choice.get("logprobs") or {}).get("tokens"),
            "finish_reason": choice["finish_reason"],
        }
    record.inputs["reference"] = {"prompt": REFERENCE_PROMPT, "max_tokens": REFERENCE_TOKENS}
    return s.cache["reference"]


REFERENCE_PROMPT = "Once upon a time, in a quiet harbour town,"
REFERENCE_TOKENS = 32
