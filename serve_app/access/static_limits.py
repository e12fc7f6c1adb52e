"""Static request limits: n, max_tokens, stop sequences, grammar and tool sizes, prompt tokens.

Checked on the parsed request before any model state is allocated; each rejection names the
limit that fired (400, or `context_length_exceeded` / `max_tokens_exceeded`). The per-key
budgets that change over time are in `serve_app.access.budgets`.
"""

from __future__ import annotations

import json
from typing import Any

from serve_app import errors
from serve_app.access.keys import Principal, require_model


def _tightest(*limits: int | None) -> int | None:
    given = [x for x in limits if x is not None]
    return min(given) if given else None


# --------------------------------------------------------------------- static checks


def check_request(principal: Principal, req: Any, server: Any) -> None:
    """Permission and size checks on a parsed OpenAI request, before any content is
    loaded. `server` is the ServeConfig's LimitOptions. (max_tokens is decided once the
    prompt is tokenized: `serve_app.access.output_budget`.)"""
    require_model(principal, req.model)
    key = principal.limits
    n = req.n or 1
    max_n = _tightest(server.max_n, key.max_n)
    if max_n is not None and n > max_n:
        raise errors.request_limit_exceeded("max_n", n, max_n, "n")
    num_stops = len(req.stop_strings())
    max_stops = _tightest(server.max_stop_sequences, key.max_stop_sequences)
    if max_stops is not None and num_stops > max_stops:
        raise errors.request_limit_exceeded("max_stop_sequences", num_stops, max_stops, "stop")
    spec = req.grammar_spec()
    if spec is not None and key.max_grammar_bytes is not None:
        size = len(spec.spec.encode())
        if size > key.max_grammar_bytes:
            param = req.grammar_param() or "response_format"
            raise errors.request_limit_exceeded(
                "max_grammar_bytes", size, key.max_grammar_bytes, param
            )
    check_tools(getattr(req, "tools", None), key, server)


def check_tools(tools: list[Any] | None, key: Any, server: Any) -> None:
    if not tools:
        return
    max_tools = _tightest(getattr(server, "max_tools", None), key.max_tools)
    if max_tools is not None and len(tools) > max_tools:
        raise errors.request_limit_exceeded("max_tools", len(tools), max_tools, "tools")
    max_bytes = _tightest(getattr(server, "max_tool_bytes", None), key.max_tool_bytes)
    if max_bytes is not None:
        dumped = [t.model_dump() if hasattr(t, "model_dump") else t for t in tools]
        size = len(json.dumps(dumped, separators=(",", ":")).encode())
        if size > max_bytes:
            raise errors.request_limit_exceeded("max_tool_bytes", size, max_bytes, "tools")


def check_prompt_tokens(principal: Principal, prompts: list[list[int]], param: str) -> None:
    bound = principal.limits.max_prompt_tokens
    if bound is None:
        return
    for ids in prompts:
        if len(ids) > bound:
            raise errors.context_length_exceeded(
                f"The prompt has {len(ids)} tokens; the limit max_prompt_tokens allows at "
                f"most {bound}.",
                param=param,
            )
