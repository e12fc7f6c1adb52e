"""Request identity (`X-Request-Id`): one live attempt per id, and replay of a completed one.

A second live request with the same id (same tenant) is a 409. After completion the same
id with the same body returns the recorded result within the retention window (as SSE
ending in [DONE] when the replay asks to stream) instead of generating again; a different
body is a 409. After a cancelled or failed attempt the id is free for a new attempt. The
record is made before the terminal event is sent, so a retry right after [DONE] replays.

NOTE: the table lives in the ingress replica's memory; with several ingress replicas the
durable store has to hold it.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.responses import JSONResponse, Response, StreamingResponse

from serve_app import errors
from serve_app.access import client_json
from serve_app.openai.streaming import DONE, sse
from serve_app.protocol.event_stream import EventStreamResponse

HEADER = "x-request-id"
MAX_ID_CHARS = 256


@dataclass
class _Record:
    body_hash: str
    live: bool
    result: dict | None = None
    expires_at: float = 0.0


def serve_request_id() -> str:
    """The id Serve's proxy gave this request (the client's X-Request-Id when it sent one),
    which the proxy also returns in the response's X-Request-Id header."""
    try:
        from ray.serve.context import _get_serve_request_context

        return _get_serve_request_context().request_id
    except Exception:  # noqa: BLE001 (outside a Serve replica)
        return ""


def body_hash(body: bytes | dict[str, Any]) -> str:
    """sha256 of the body's JSON with its keys sorted and no whitespace, so that a retry
    spelled with another key order or spacing is the same request. `body` is the bytes or,
    where the endpoint parsed them already, the object they hold (parsing twice cost a
    request with a 2,000-id prompt 0.17 ms); bytes that are not JSON identify themselves."""
    if isinstance(body, bytes | bytearray):
        try:
            body = client_json.loads(body)
        except errors.APIError:
            return hashlib.sha256(body).hexdigest()
    try:
        canonical = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # an integer beyond 64 bits (orjson's JSONEncodeError is a TypeError)
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()


class RequestIds:
    def __init__(self, retention_s: float, clock: Callable[[], float] = time.monotonic):
        self.retention_s = retention_s
        self._clock = clock
        self.records: dict[tuple[str, str], _Record] = {}
        # (expires_at, key) of each completed record, oldest first: every record is kept for
        # the same `retention_s`, so they expire in the order they completed and a purge
        # looks only at the expired ones (a scan of the whole table cost each request time in
        # proportion to the requests of the last `retention_s`).
        self._expiry: deque[tuple[float, tuple[str, str]]] = deque()

    def _purge(self) -> None:
        now = self._clock()
        while self._expiry and self._expiry[0][0] <= now:
            expires_at, key = self._expiry.popleft()
            rec = self.records.get(key)
            # A key whose record was made again since (a new attempt) keeps the new one.
            if rec is not None and not rec.live and rec.expires_at == expires_at:
                del self.records[key]

    async def guard(
        self,
        request_id: str | None,
        tenant: str,
        body: bytes | dict[str, Any],
        stream: bool,
        include_usage: bool,
        handler: Callable[[Callable[[dict], None]], Awaitable[Response]],
    ) -> Response:
        """Run `handler(record)` as the one live attempt of this id; `record(result)` must be
        called with the terminal non-streamed body before the terminal event goes out."""
        self._purge()
        rid = request_id or serve_request_id() or uuid.uuid4().hex
        if len(rid) > MAX_ID_CHARS or not rid.isprintable():
            raise errors.invalid_request(
                f"X-Request-Id must be 1 to {MAX_ID_CHARS} printable characters.", "X-Request-Id"
            )
        key, digest = (tenant, rid), body_hash(body)
        rec = self.records.get(key)
        if rec is not None:
            if rec.live:
                raise errors.conflict(
                    "request_id_in_use", f"A request with id {rid!r} is still running."
                )
            if rec.body_hash != digest:
                raise errors.conflict(
                    "request_id_in_use",
                    f"Request id {rid!r} was used with a different body; use a new id.",
                )
            return self._replay(rid, rec.result or {}, stream, include_usage)
        self.records[key] = _Record(digest, live=True)

        def record(result: dict) -> None:
            expires_at = self._clock() + self.retention_s
            self.records[key] = _Record(digest, False, result, expires_at)
            self._expiry.append((expires_at, key))

        try:
            response = await handler(record)
        except BaseException:
            self._release(key)
            raise
        if HEADER not in response.headers and not serve_request_id():
            # Serve's proxy echoes the id itself (it adopts the client's X-Request-Id).
            response.headers[HEADER] = rid
        if isinstance(response, StreamingResponse):
            response.body_iterator = self._release_unless_recorded(key, response.body_iterator)
        elif self.records.get(key, _Record("", True)).live:
            self._release(key)
        return response

    def _release(self, key: tuple[str, str]) -> None:
        rec = self.records.get(key)
        if rec is not None and rec.live:
            del self.records[key]

    async def _release_unless_recorded(self, key, body: AsyncIterator[bytes]):
        try:
            async for chunk in body:
                yield chunk
        finally:
            # A stream that ended without its terminal record (cancelled, failed) frees the
            # id for a new, fenced attempt.
            self._release(key)

    def _replay(self, rid: str, result: dict, stream: bool, include_usage: bool) -> Response:
        headers = {"x-replayed": "true"} if serve_request_id() else {HEADER: rid}
        headers["x-replayed"] = "true"
        if not stream:
            return JSONResponse(result, headers=headers)
        return EventStreamResponse(
            _replay_chunks(result, include_usage), media_type="text/event-stream", headers=headers
        )


async def _replay_chunks(result: dict, include_usage: bool) -> AsyncIterator[bytes]:
    """A recorded body as a stream in the contract's order, ending in [DONE]."""
    chat = result.get("object") == "chat.completion"
    base = {k: result[k] for k in ("id", "created", "model", "system_fingerprint") if k in result}
    base["object"] = "chat.completion.chunk" if chat else "text_completion"
    for choice in result.get("choices", []):
        i = choice["index"]
        # `return_token_ids`: the ids ride on the choice's first content chunk, as live.
        ids = {k: choice[k] for k in ("token_ids", "prompt_token_ids") if k in choice}
        if chat:
            message = choice.get("message") or {}
            prompt = {k: result[k] for k in ("prompt_token_ids",) if k in result and i == 0}
            role = {"index": i, "delta": {"role": "assistant", "content": ""}}
            yield sse({**base, "choices": [role], **prompt})
            for j, delta in enumerate(_message_deltas(message)):
                yield sse(
                    {**base, "choices": [{"index": i, "delta": delta, **(ids if j == 0 else {})}]}
                )
            end = {"index": i, "delta": {}}
        else:
            yield sse({**base, "choices": [{"index": i, "text": choice.get("text", ""), **ids}]})
            end = {"index": i, "text": ""}
        end.update(finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason"))
        yield sse({**base, "choices": [end]})
    if include_usage:
        yield sse({**base, "choices": [], "usage": result.get("usage")})
    yield DONE


def _message_deltas(message: dict) -> list[dict]:
    """A recorded chat message as stream deltas: reasoning, content, then each tool call (its
    id, type and name first, then its arguments), as the live stream sent them."""
    deltas: list[dict] = []
    if message.get("reasoning_content"):
        deltas.append({"reasoning_content": message["reasoning_content"]})
    deltas.append({"content": message.get("content") or ""})
    for j, call in enumerate(message.get("tool_calls") or []):
        function = call["function"]
        head = {"index": j, "id": call["id"], "type": call["type"]}
        deltas.append(
            {"tool_calls": [{**head, "function": {"name": function["name"], "arguments": ""}}]}
        )
        deltas.append(
            {"tool_calls": [{"index": j, "function": {"arguments": function["arguments"]}}]}
        )
    return deltas
