"""What keeping a stored response's events costs the store: writes and bytes per response.

Runs the stored-response runner (serve_app/responses/runner.py) on a scripted engine that
emits one token per output, at a few lengths and token rates, against a real SQLite store,
and prints JSON: events, record writes (insert + batched updates + the terminal one), the
final record's size, the stored events' size, and the bytes written over the response's life
(each write's record plus the events it appends).

    .venv/bin/python benchmarks/response_store_writes.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from actors.messages import EngineRequest
from actors.outputs import CompletionDelta, RequestOutput
from actors.request import FinishReason
from actors.sampling_params import SamplingParams
from serve_app.parsers.chat_output import ParseOptions
from serve_app.responses.admission import AdmittedResponse
from serve_app.responses.protocol import parse_body
from serve_app.responses.runner import ResponseRunner
from serve_app.store.sqlite import SQLiteStore

CASES = ((100, 0.0), (1000, 0.0), (1000, 0.01), (4000, 0.0))  # (tokens, seconds per token)
# A run that checks the script works (the suite's): no case that waits between tokens.
QUICK_CASES = ((100, 0.0), (1000, 0.0))


class CountingStore(SQLiteStore):
    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.num_bytes = 0

    def insert_response(self, record: Any, events: Any = ()) -> None:
        self.num_bytes += written_bytes(record, events)
        super().insert_response(record, events)

    def update_response(self, record: Any, expected: Any, events: Any = ()) -> bool:
        self.num_bytes += written_bytes(record, events)
        return super().update_response(record, expected, events)


def written_bytes(record: Any, events: Any) -> int:
    return len(json.dumps(record.data)) + sum(len(json.dumps(event)) for event in events)


class Engine:
    def __init__(self, num_tokens: int, per_token_s: float) -> None:
        self.num_tokens, self.per_token_s = num_tokens, per_token_s
        self.generate = self

    def remote(self, request: Any) -> Any:
        return Stream(self.num_tokens, self.per_token_s)


class Stream:
    """Serve's streaming handle in small: async outputs and `cancel()`."""

    def __init__(self, num_tokens: int, per_token_s: float) -> None:
        self.num_left, self.per_token_s = num_tokens, per_token_s

    def cancel(self) -> None:
        self.num_left = 0

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> RequestOutput:
        await asyncio.sleep(self.per_token_s)
        if self.num_left == 0:
            raise StopAsyncIteration
        self.num_left -= 1
        finish = FinishReason.LENGTH if self.num_left == 0 else None
        delta = CompletionDelta(0, [7], "tok ", None, finish)
        return RequestOutput("r", [1], [delta], 0, finish is not None)


async def first_output(gen: Any, read: Any) -> Any:
    return await read


def base_of(adm: AdmittedResponse) -> Any:
    def base(status: str, output: list, usage: Any, **kwargs: Any) -> dict:
        return {"id": adm.response_id, "status": status, "output": list(output), "usage": usage}

    return base


def measure(num_tokens: int, per_token_s: float) -> dict[str, Any]:
    store = CountingStore(Path(tempfile.mkdtemp()) / "store.sqlite3")
    req = parse_body(b'{"model": "m", "input": "hi", "background": true}')
    adm = AdmittedResponse(
        req=req, chat=None,  # type: ignore[arg-type]
        tenant="t", response_id="resp_1", created_at=time.time(),
        engine_request=EngineRequest("resp_1", [1], SamplingParams(max_tokens=num_tokens)),
        parse=ParseOptions(),
    )  # fmt: skip

    async def run() -> Any:
        runner = ResponseRunner(store, Engine(num_tokens, per_token_s), base_of, first_output,
                                3600.0, 60.0, 3600.0)  # fmt: skip
        live = await runner.start(adm)
        await asyncio.wait([live.done])
        return live

    live = asyncio.run(run())
    record = store.get_response("t", "resp_1")
    events = store.get_response_events("t", "resp_1", -1)
    assert record is not None and len(events) == len(live.events)
    store.close()
    return {
        "output_tokens": num_tokens,
        "seconds_per_token": per_token_s,
        "events": len(live.events),
        "store_writes": live.num_writes,
        "record_bytes": len(json.dumps(record.data)),
        "event_bytes": sum(len(json.dumps(event)) for event in events),
        "bytes_written": store.num_bytes,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="only the cases with no token rate")
    cases = QUICK_CASES if parser.parse_args().quick else CASES
    print(json.dumps([measure(n, s) for n, s in cases], indent=2))
