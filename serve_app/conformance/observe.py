"""What a case records of an answer, in the shapes the diff understands by their key names:

- a generation (`generation`, or a list under `generations`): `text`, `token_ids` (when the
  server returns them), `finish_reason`, `stop_reason`, `logprobs` (per token: `token`,
  `logprob`, `top` as `[token, logprob]` pairs, best first), `tool_calls`, `greedy`;
- `shape`: the sorted field paths of a JSON answer (`choices[].message.content`); a stream's is
  the union over its chunks, so chunk boundaries never show;
- `events`: a stream's event order, per choice and for the stream, runs collapsed;
- an error: `status`, `code`, `type`, `param`, `headers` (the retry headers), `shape`.
"""

from __future__ import annotations

from typing import Any

from serve_app.conformance.session import DONE, Stream

# The headers a client's retry logic reads, recorded on every error.
RETRY_HEADERS = ("x-should-retry", "retry-after", "www-authenticate", "allow")


def shape(value: Any, prefix: str = "") -> list[str]:
    """Sorted field paths of a JSON value; list items share one `[]` path."""
    found: set[str] = set()
    _walk_shape(value, prefix, found)
    return sorted(found)


def _walk_shape(value: Any, prefix: str, found: set[str]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            found.add(path)
            _walk_shape(item, path, found)
    elif isinstance(value, list):
        for item in value:
            _walk_shape(item, f"{prefix}[]", found)


def union_shape(chunks: list[dict[str, Any]]) -> list[str]:
    found: set[str] = set()
    for chunk in chunks:
        _walk_shape(chunk, "", found)
    return sorted(found)


# ---------------------------------------------------------------------- errors


def header_facts(headers: dict[str, str]) -> dict[str, Any]:
    """The retry headers as facts: `x-should-retry` by value, the others by presence
    (`Retry-After` also whether it is whole seconds >= 1)."""
    lower = {k.lower(): v for k, v in headers.items()}
    facts: dict[str, Any] = {"x-should-retry": lower.get("x-should-retry")}
    retry_after = lower.get("retry-after")
    facts["retry-after"] = None if retry_after is None else _retry_after_fact(retry_after)
    facts["www-authenticate"] = lower.get("www-authenticate")
    facts["allow"] = (
        sorted(m.strip() for m in lower["allow"].split(",")) if "allow" in lower else None
    )
    return facts


def _retry_after_fact(value: str) -> str:
    try:
        return "seconds>=1" if int(value) >= 1 else "seconds<1"
    except ValueError:
        return "not whole seconds"


def error_facts(status: int, headers: dict[str, str], body: Any) -> dict[str, Any]:
    error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {}
    return {
        "status": status,
        "code": error.get("code"),
        "type": error.get("type"),
        "param": error.get("param"),
        "headers": header_facts(headers),
        "shape": shape(body) if isinstance(body, dict) else ["<not JSON>"],
    }


def is_error_shape(body: Any) -> bool:
    """The one error shape: {"error": {"message", "type", "code", "param"}}."""
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and {"message", "type", "code", "param"} <= set(error)


# ----------------------------------------------------------------- generations


def chat_generation(choice: dict[str, Any], greedy: bool) -> dict[str, Any]:
    message = choice.get("message") or {}
    content = (choice.get("logprobs") or {}).get("content")
    return {
        "text": message.get("content") or "",
        "reasoning": message.get("reasoning_content"),
        "tool_calls": [_tool_call(c) for c in message.get("tool_calls") or []] or None,
        "token_ids": choice.get("token_ids"),
        "finish_reason": choice.get("finish_reason"),
        "stop_reason": choice.get("stop_reason"),
        "logprobs": [_chat_logprob(e) for e in content] if content is not None else None,
        "greedy": greedy,
    }


def completion_generation(choice: dict[str, Any], greedy: bool) -> dict[str, Any]:
    return {
        "text": choice.get("text") or "",
        "token_ids": choice.get("token_ids"),
        "finish_reason": choice.get("finish_reason"),
        "stop_reason": choice.get("stop_reason"),
        "logprobs": _completion_logprobs(choice.get("logprobs")),
        "greedy": greedy,
    }


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    return {"name": function.get("name"), "arguments": function.get("arguments")}


def _chat_logprob(entry: dict[str, Any]) -> dict[str, Any]:
    top = entry.get("top_logprobs") or []
    return {
        "token": entry.get("token"),
        "bytes": entry.get("bytes"),
        "logprob": entry.get("logprob"),
        "top": [[t.get("token"), t.get("logprob")] for t in top],
    }


def _completion_logprobs(logprobs: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    if not logprobs:
        return None
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    out = []
    for token, value, top in zip(tokens, values, tops, strict=False):
        pairs = sorted((top or {}).items(), key=lambda kv: -kv[1])
        out.append({"token": token, "logprob": value, "top": [list(p) for p in pairs]})
    return out


def stream_generations(stream: Stream, greedy: bool, chat: bool) -> list[dict[str, Any]]:
    """Per choice index, the streamed pieces joined: what the non-streamed answer would say."""
    by_index: dict[int, dict[str, Any]] = {}
    for chunk in stream.chunks:
        for choice in chunk.get("choices") or []:
            gen = by_index.setdefault(choice.get("index", 0), _empty_generation(greedy, chat))
            _add_piece(gen, choice, chat)
    return [_close_generation(by_index[i]) for i in sorted(by_index)]


def _empty_generation(greedy: bool, chat: bool) -> dict[str, Any]:
    gen: dict[str, Any] = {"text": "", "token_ids": None, "finish_reason": None}
    gen.update(stop_reason=None, logprobs=None, greedy=greedy)
    if chat:
        gen.update(reasoning=None, tool_calls={})
    return gen


def _add_piece(gen: dict[str, Any], choice: dict[str, Any], chat: bool) -> None:
    if chat:
        delta = choice.get("delta") or {}
        gen["text"] += delta.get("content") or ""
        if delta.get("reasoning_content"):
            gen["reasoning"] = (gen["reasoning"] or "") + delta["reasoning_content"]
        for call in delta.get("tool_calls") or []:
            slot = gen["tool_calls"].setdefault(
                call.get("index", 0), {"name": None, "arguments": ""}
            )
            function = call.get("function") or {}
            slot["name"] = slot["name"] or function.get("name")
            slot["arguments"] += function.get("arguments") or ""
        content = (choice.get("logprobs") or {}).get("content")
        if content:
            gen["logprobs"] = (gen["logprobs"] or []) + [_chat_logprob(e) for e in content]
    else:
        gen["text"] += choice.get("text") or ""
        pieces = _completion_logprobs(choice.get("logprobs"))
        if pieces:
            gen["logprobs"] = (gen["logprobs"] or []) + pieces
    if choice.get("token_ids") is not None:
        gen["token_ids"] = (gen["token_ids"] or []) + list(choice["token_ids"])
    if choice.get("finish_reason") is not None:
        gen["finish_reason"] = choice["finish_reason"]
        gen["stop_reason"] = choice.get("stop_reason")


def _close_generation(gen: dict[str, Any]) -> dict[str, Any]:
    if "tool_calls" in gen:
        calls = [gen["tool_calls"][i] for i in sorted(gen["tool_calls"])]
        gen["tool_calls"] = calls or None
    return gen


def stream_usage(stream: Stream) -> dict[str, Any] | None:
    usages = [c["usage"] for c in stream.chunks if c.get("usage")]
    return usages[-1] if usages else None


# ---------------------------------------------------------------------- events


def stream_events(stream: Stream) -> dict[str, Any]:
    """The event order, runs collapsed: `stream` (choice / usage / error / [DONE] / after
    [DONE]) and per choice (role / delta / finish)."""
    overall: list[str] = []
    per_choice: dict[int, list[str]] = {}
    finishes: dict[int, int] = {}
    for event in stream.events:
        if event == DONE:
            _push(overall, DONE)
            continue
        if not isinstance(event, dict) or "error" in event:
            _push(overall, "error")
            continue
        choices = event.get("choices") or []
        if choices:
            _push(overall, "choice")
        elif event.get("usage"):
            _push(overall, "usage")
        for choice in choices:
            index = choice.get("index", 0)
            kinds = per_choice.setdefault(index, [])
            for kind in _choice_kinds(choice):
                _push(kinds, kind)
                if kind == "finish":
                    finishes[index] = finishes.get(index, 0) + 1
    if stream.after_done:
        overall.append("after [DONE]")
    return {
        "stream": overall,
        "choices": {str(i): per_choice[i] for i in sorted(per_choice)},
        "finish_events": {str(i): finishes.get(i, 0) for i in sorted(per_choice)},
    }


def _push(kinds: list[str], kind: str) -> None:
    if not kinds or kinds[-1] != kind:
        kinds.append(kind)


def _choice_kinds(choice: dict[str, Any]) -> list[str]:
    kinds = []
    delta = choice.get("delta")
    if delta is not None and delta.get("role"):
        kinds.append("role")
    has_output = (
        (delta or {}).get("content")
        or (delta or {}).get("reasoning_content")
        or (delta or {}).get("tool_calls")
        or choice.get("text")
    )
    if has_output:
        kinds.append("delta")
    if choice.get("finish_reason") is not None:
        kinds.append("finish")
    return kinds


def order_violations(events: dict[str, Any], chat: bool, usage_asked: bool) -> list[str]:
    """Role → deltas → one finish per choice → usage (when asked) → [DONE], nothing after."""
    wrong = []
    for index, kinds in events["choices"].items():
        if chat and (not kinds or kinds[0] != "role"):
            wrong.append(f"choice {index}: the first event is {kinds[:1]}, not the role")
        if "finish" not in kinds or kinds[-1] != "finish":
            wrong.append(f"choice {index}: events {kinds} do not end with its finish")
        if events["finish_events"][index] != 1:
            wrong.append(f"choice {index}: {events['finish_events'][index]} finish events")
    tail = ["usage", DONE] if usage_asked else [DONE]
    expected = ["choice", *tail]
    if events["stream"] != expected:
        wrong.append(f"stream events {events['stream']}, expected {expected}")
    return wrong
