"""The response object at each status, and what the engine's first output means: shared by
the ingress (a `store: false` response runs there) and the runner deployment (stored ones)."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from actors.outputs import RequestOutput
from serve_app import errors
from serve_app.protocol.deadlines import HEADER_PARAM
from serve_app.responses.admission import AdmittedResponse
from serve_app.responses.chat_request import renamed

logger = logging.getLogger(__name__)

Builder = Callable[..., dict[str, Any]]


def object_builder(identity: dict[str, Any]) -> Callable[[AdmittedResponse], Builder]:
    """`builder(admitted)(status, output, usage, error=..., incomplete_reason=...)`."""

    def of(admitted: AdmittedResponse) -> Builder:
        def build(status: str, output: list[dict[str, Any]], usage: Any, **kwargs: Any) -> Any:
            return response_object(identity, admitted, status, output, usage, **kwargs)

        return build

    return of


def response_object(
    identity: dict[str, Any],
    admitted: AdmittedResponse,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    *,
    error: dict[str, str] | None = None,
    incomplete_reason: str | None = None,
) -> dict[str, Any]:
    """The response object at `status` (its items copied: later deltas never change a frame
    already built)."""
    req = admitted.req
    fmt = req.text.format if req.text is not None else None
    text_format = fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
    tool_choice: Any = req.tool_choice
    if tool_choice is None:
        tool_choice = "auto" if req.tools else "none"
    elif not isinstance(tool_choice, str):
        tool_choice = tool_choice.model_dump()
    sampling = admitted.engine_request.params
    return {
        "id": admitted.response_id,
        "object": "response",
        "created_at": int(admitted.created_at),
        "status": status,
        "background": bool(req.background),
        "error": error,
        "incomplete_details": (
            {"reason": incomplete_reason} if incomplete_reason is not None else None
        ),
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": req.model,
        "output": json.loads(json.dumps(output)),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "conversation": (
            {"id": admitted.conversation_id} if admitted.conversation_id is not None else None
        ),
        "reasoning": {"effort": None, "summary": None},
        "store": req.store,
        "temperature": sampling.temperature,
        "text": {"format": text_format},
        "tool_choice": tool_choice,
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
        "top_p": sampling.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": req.user,
        "metadata": req.metadata or {},
        # The served artifact, as every family names it.
        "system_fingerprint": identity["fingerprint"],
    }


async def first_output(gen: Any, read: Awaitable[RequestOutput] | None = None) -> RequestOutput:
    """The engine stream's first output, which decides the status: a grammar that failed is
    a 400 here, an engine that is gone a retryable 500. `read`: how to take it when not
    `gen.__anext__()` (a channel-naming call: `EngineChannels.first_output`)."""
    try:
        out = await (read if read is not None else gen.__anext__())
    except errors.APIError as exc:
        raise errors.api_error_in(exc) or exc from None
    except ValueError as exc:
        raise errors.invalid_request(str(exc), "input") from exc
    except Exception as exc:
        found = errors.api_error_in(exc)
        if found is not None:
            raise found from None
        logger.error("engine refused response: %s", type(exc).__name__)
        raise errors.internal_error("The engine is unavailable.", retryable=True) from exc
    if out.error is not None or out.error_code is not None:
        raise renamed(first_error(out))
    return out


def first_error(out: RequestOutput) -> errors.APIError:
    """The API error an engine's refusal of the first output stands for (nothing was sent:
    a repeat is safe). A response's deadline can only come from the header."""
    return errors.engine_refusal(
        out.error_code,
        out.error or out.error_code or "the engine failed",
        grammar_param="text.format",
        deadline_param=HEADER_PARAM,
        retryable=True,
    )
