"""One response's run on scripted engine outputs, without a server: the event order, the
reasoning item and its token count, the record saved before the terminal event, and what a
lost engine, a cut output and an engine error become."""

from __future__ import annotations

import asyncio
from typing import Any

from actors.messages import EngineRequest
from actors.outputs import CompletionDelta, RequestOutput
from actors.request import FinishReason
from actors.sampling_params import SamplingParams
from serve_app.parsers.chat_output import ParseOptions
from serve_app.responses.admission import AdmittedResponse
from serve_app.responses.protocol import parse_body
from serve_app.responses.run import ResponseRun

PROMPT = [1, 2, 3, 4]


def admitted() -> AdmittedResponse:
    req = parse_body(b'{"model": "m", "input": "hi"}')
    request = EngineRequest("resp_x", PROMPT, SamplingParams(max_tokens=16))
    return AdmittedResponse(
        req=req,
        chat=None,  # type: ignore[arg-type]  # the run never reads it
        tenant="t",
        response_id="resp_x",
        created_at=0.0,
        engine_request=request,
        parse=ParseOptions(reasoning=True),
    )


def output(*texts: str, finish: FinishReason | None = None, cached: int = 2) -> RequestOutput:
    deltas = [CompletionDelta(0, [7], text) for text in texts]
    if finish is not None:
        deltas[-1] = CompletionDelta(0, [7], texts[-1], finish_reason=finish)
    return RequestOutput("resp_x", PROMPT, deltas, cached, finish is not None)


async def scripted(outputs: list[Any]):
    for out in outputs:
        if isinstance(out, Exception):
            raise out
        yield out


def run(first: RequestOutput, rest: list[Any]) -> tuple[list[dict], list[str], ResponseRun]:
    log: list[str] = []

    def base(status: str, items: list, usage: Any, **kwargs: Any) -> dict:
        return {"status": status, "output": list(items), "usage": usage, **kwargs}

    async def save(adm: AdmittedResponse, final: dict) -> None:
        log.append(f"saved {final['status']}")

    async def main() -> list[dict]:
        events = []
        async for event in response_run.events(first, scripted(rest)):
            log.append(event["type"])
            events.append(event)
        return events

    response_run = ResponseRun(admitted(), base, save)
    return asyncio.run(main()), log, response_run


def test_reasoning_then_text_and_the_tokens_each_took():
    events, log, response_run = run(
        output("<think>", "hm"),
        [output("</think>", "Hi", finish=FinishReason.STOP)],
    )
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"][0]["text"] == "hm"
    assert final["output"][1]["content"][0]["text"] == "Hi"
    usage = final["usage"]
    assert usage["output_tokens"] == 4 and usage["output_tokens_details"]["reasoning_tokens"] == 3
    assert usage["input_tokens"] == 4 and usage["input_tokens_details"]["cached_tokens"] == 2
    # Saved before the terminal event leaves; nothing after it.
    assert log[-2:] == ["saved completed", "response.completed"]
    assert log[:2] == ["response.created", "response.in_progress"]


def test_a_cut_output_is_incomplete_and_its_open_item_too():
    events, log, _ = run(output("Hel"), [output("lo", finish=FinishReason.LENGTH)])
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete"
    assert final["incomplete_reason"] == "max_output_tokens"
    assert final["output"][0]["status"] == "incomplete"


def test_a_lost_engine_fails_the_response_with_what_it_had():
    events, log, _ = run(output("Hel"), [RuntimeError("replica died")])
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.failed" and log[-2] == "saved failed"
    assert final["error"]["code"] == "engine_lost"
    assert final["output"][0]["content"][0]["text"] == "Hel"


def test_an_engine_that_ends_early_or_reports_an_error_fails_it():
    events, _, _ = run(output("Hel"), [])
    assert events[-1]["response"]["error"]["code"] == "engine_lost"
    failing = RequestOutput("resp_x", PROMPT, [], 0, True, error="boom", error_code="engine_lost")
    events, _, _ = run(output("Hel"), [failing])
    assert events[-1]["response"]["error"] == {"code": "engine_lost", "message": "boom"}
