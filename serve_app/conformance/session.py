"""The server under test, as the cases reach it: raw HTTP (httpx), the official `openai`
client, the admin port when one is given, and an SSE reader that keeps every event."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import httpx

DONE = "[DONE]"


@dataclass(frozen=True)
class Target:
    """Where the server is and how to reach it (the `conformance run` flags)."""

    base_url: str
    api_key: str | None = None
    admin_url: str | None = None
    admin_key: str | None = None
    model: str | None = None
    # A key whose limits say `max_concurrent_requests: 1`: the 429 case needs one.
    limited_key: str | None = None
    # A key whose `models` leave out the served one: the 403 case needs one.
    restricted_key: str | None = None
    timeout_s: float = 120.0

    @property
    def root(self) -> str:
        """The server's root URL: `--base-url` with or without its `/v1`."""
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass
class Stream:
    """One streamed answer: status, headers, the `data:` payloads in order (JSON decoded,
    `[DONE]` kept as the string), the `event:` names in order (typed streams such as
    `/v1/responses` send one before each payload), what came after `[DONE]`, and when events
    arrived."""

    status: int
    headers: dict[str, str]
    events: list[Any] = field(default_factory=list)
    event_names: list[str] = field(default_factory=list)
    after_done: list[str] = field(default_factory=list)
    body: Any = None  # the JSON body of a refusal (no stream)
    ttft_s: float | None = None
    total_s: float = 0.0

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [e for e in self.events if isinstance(e, dict)]

    @property
    def done(self) -> bool:
        return DONE in self.events


class Session:
    """One run against one server; the cases share it (and its cached references)."""

    def __init__(self, target: Target):
        self.target = target
        headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
        self.http = httpx.Client(base_url=target.root, headers=headers, timeout=target.timeout_s)
        self.cache: dict[str, Any] = {}

    def close(self) -> None:
        self.http.close()

    # ------------------------------------------------------------------ identity

    @cached_property
    def server_info(self) -> dict[str, Any] | None:
        r = self.http.get("/v1/server_info")
        if r.status_code != 200:
            return None
        try:
            info = r.json()
        except ValueError:
            return None
        return info if isinstance(info, dict) else None

    @cached_property
    def models(self) -> list[dict[str, Any]]:
        r = self.http.get("/v1/models")
        r.raise_for_status()
        return list(r.json().get("data") or [])

    @cached_property
    def model(self) -> str:
        if self.target.model:
            return self.target.model
        if not self.models:
            raise RuntimeError("/v1/models lists no model; pass --model")
        return self.models[0]["id"]

    @cached_property
    def max_model_len(self) -> int | None:
        limits = (self.server_info or {}).get("limits") or {}
        if isinstance(limits.get("max_model_len"), int):
            return limits["max_model_len"]
        entry = next((m for m in self.models if m.get("id") == self.model), {})
        value = entry.get("max_model_len")
        return value if isinstance(value, int) else None

    def limit(self, name: str) -> Any:
        """A limit `/v1/server_info` states (`limits.<name>`), or None."""
        return ((self.server_info or {}).get("limits") or {}).get(name)

    # ------------------------------------------------------------------ clients

    @cached_property
    def openai(self):
        """The official client, without its own retries (a retry would hide a status)."""
        import openai

        return openai.OpenAI(
            base_url=f"{self.target.root}/v1",
            api_key=self.target.api_key or "unused",
            max_retries=0,
            timeout=self.target.timeout_s,
        )

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
        if isinstance(body, bytes | str):
            headers = {"Content-Type": "application/json", **(headers or {})}
            return self.http.post(path, content=body, headers=headers)
        return self.http.post(path, json=body, headers=headers)

    def stream(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> Stream:
        started = time.perf_counter()
        with self.http.stream("POST", path, json=body, headers=headers) as r:
            out = Stream(status=r.status_code, headers=dict(r.headers))
            if r.status_code != 200:
                r.read()
                out.body = _json_or_text(r.text)
                out.total_s = time.perf_counter() - started
                return out
            for line in r.iter_lines():
                self._read_line(out, line, started)
        out.total_s = time.perf_counter() - started
        return out

    def open_stream(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> LiveStream:
        """A stream the caller reads at its own pace (and may leave early)."""
        request = self.http.build_request("POST", path, json=body, headers=headers)
        return LiveStream(self.http.send(request, stream=True))

    @staticmethod
    def _read_line(out: Stream, line: str, started: float) -> None:
        if not line or line.startswith(":"):  # blank separators and SSE comments
            return
        if out.done:
            out.after_done.append(line)
            return
        if line.startswith("event:"):
            out.event_names.append(line[len("event:") :].strip())
            return
        if not line.startswith("data:"):
            out.events.append({"unparsed_line": line})
            return
        payload = line[len("data:") :].strip()
        if payload == DONE:
            out.events.append(DONE)
            return
        event = _json_or_text(payload)
        if out.ttft_s is None and _carries_output(event):
            out.ttft_s = time.perf_counter() - started
        out.events.append(event)

    # ------------------------------------------------------------------ admin port

    def admin_stats(self) -> dict[str, Any] | None:
        """The admin port's totals (`kv_blocks_used`, `live_requests`, `held`, ...)."""
        if not self.target.admin_url:
            return None
        r = httpx.get(
            f"{self.target.admin_url.rstrip('/')}/admin/v1/stats",
            headers=self._admin_headers(),
            timeout=10,
        )
        r.raise_for_status()
        return r.json().get("total")

    def admin_post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(
            f"{self.target.admin_url.rstrip('/')}{path}",
            json=body,
            headers=self._admin_headers(),
            timeout=10,
        )

    def _admin_headers(self) -> dict[str, str]:
        key = self.target.admin_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def wait_admin(self, predicate, timeout_s: float) -> tuple[bool, float, dict | None]:
        """Poll the admin totals until `predicate(totals)`: (reached, seconds, last totals)."""
        started = time.monotonic()
        while True:
            stats = self.admin_stats()
            elapsed = time.monotonic() - started
            if stats is not None and predicate(stats):
                return True, elapsed, stats
            if elapsed > timeout_s:
                return False, elapsed, stats
            time.sleep(0.05)


class LiveStream:
    """An open SSE response: read up to the first output, read the rest, or leave."""

    def __init__(self, response: httpx.Response):
        self.response = response
        self.started = time.perf_counter()
        self.stream = Stream(status=response.status_code, headers=dict(response.headers))
        self._lines = response.iter_lines() if response.status_code == 200 else iter(())
        if response.status_code != 200:
            response.read()
            self.stream.body = _json_or_text(response.text)
            response.close()

    def read_outputs(self, count: int = 1) -> int:
        """Read until `count` events that carry output have arrived; how many did."""
        seen = 0
        for line in self._lines:
            before = len(self.stream.events)
            Session._read_line(self.stream, line, self.started)
            if len(self.stream.events) > before and _carries_output(self.stream.events[-1]):
                seen += 1
                if seen >= count:
                    break
        return seen

    def read_rest(self) -> Stream:
        for line in self._lines:
            Session._read_line(self.stream, line, self.started)
        self.stream.total_s = time.perf_counter() - self.started
        self.response.close()
        return self.stream

    def close(self) -> None:
        """Leave: the connection closes mid-stream (a client disconnect)."""
        self.response.close()


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _carries_output(event: Any) -> bool:
    if not isinstance(event, dict):
        return False
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or choice.get("text"):
            return True
    return False
