"""A request's engine streams as the ingress merges them (`merged_outputs`): a prompt ends only
with its finished output. An engine call that ends without it, or that raises the
`CancelledError` of a Serve call cancelled under its reader (Serve cancels a leaving client's
handle calls itself, before the cancellation reaches the stream's writer), ends the request as
`engine_lost`: an error frame once streaming, a 500 before; never a short success (a usage
chunk after an open choice) and never a wait for outputs that will not come."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from types import SimpleNamespace

import pytest
from ray.serve.exceptions import RequestCancelledError

from actors.outputs import CompletionDelta, RequestOutput
from actors.request import FinishReason
from serve_app import errors
from serve_app.openai.admission import AdmittedRequest
from serve_app.openai.format import Formatter
from serve_app.openai.stream import collect_body, stream_sse
from serve_app.protocol import parse_request
from serve_app.workers.merged_outputs import merged_outputs
from serve_app.workers.output_channel import EngineChannels, Routed

PROMPT_IDS = [1, 2, 3]
NUM_TOKENS = 6


def job(stream: bool) -> AdmittedRequest:
    body = {"model": "m", "prompt": "hi", "max_tokens": NUM_TOKENS, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    fmt = Formatter(
        chat=False, response_id="cmpl-1", model="m", fingerprint="fp", texts=None,
        want_logprobs=False, prompt_ids=[PROMPT_IDS], n=1,
    )  # fmt: skip
    engine_request = SimpleNamespace(prompt_token_ids=PROMPT_IDS)
    return AdmittedRequest(parse_request("completion", body), fmt, [engine_request], [""], 1, None)


def step(k: int) -> RequestOutput:
    """The engine's output of step k: one token; the last step finishes the request."""
    last = k == NUM_TOKENS - 1
    delta = CompletionDelta(0, [10 + k], f"t{k}", None, FinishReason.LENGTH if last else None)
    return RequestOutput("r", PROMPT_IDS, [delta], 0, last)


class Call:
    """An engine call as the ingress iterates it after its first output: `outputs`, then its
    end (`end`, when given, raised to the reader as a Serve call raises it)."""

    def __init__(self, outputs: list[RequestOutput], end: BaseException | None = None) -> None:
        self.outputs = list(outputs)
        self.end = end
        self.cancelled = False

    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> RequestOutput:
        await asyncio.sleep(0)
        if self.outputs:
            return self.outputs.pop(0)
        if self.end is not None:
            raise self.end
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


def merged(call: Call, channel_instance: str | None = None):
    """The request's merged outputs; with `channel_instance`, its later outputs were to come
    in that output channel (which delivers nothing here)."""
    channels = EngineChannels(engine=None)
    box = channels.expect("r")
    if channel_instance is not None:
        channels.routed(box, Routed("replica-a", channel_instance, step(0)))
    return merged_outputs([call], [box], [step(0)], None, channels)


def read_stream(call: Call, channel_instance: str | None = None) -> list[dict | str]:
    async def go() -> list[bytes]:
        frames = stream_sse(merged(call, channel_instance), job(stream=True))
        return [frame async for frame in frames]

    events = []
    for raw in asyncio.run(asyncio.wait_for(go(), 5)):
        data = raw.decode().removeprefix("data: ").strip()
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def collect(call: Call) -> dict:
    return asyncio.run(asyncio.wait_for(collect_body(merged(call), job(stream=False)), 5))


def text(events: list[dict | str]) -> str:
    return "".join(c["text"] for e in events if isinstance(e, dict) for c in e.get("choices") or [])


CANCELLED_UNDER_IT = asyncio.CancelledError  # what a Serve call cancelled elsewhere raises
LOST_ENDS = {
    "cancelled_under_it": lambda: Call([step(1), step(2)], CANCELLED_UNDER_IT()),
    "ended_early": lambda: Call([step(1), step(2)]),
}


@pytest.mark.parametrize("end", LOST_ENDS)
def test_a_call_that_ends_before_its_last_output_is_an_error_frame_not_a_usage_chunk(end):
    events = read_stream(LOST_ENDS[end]())
    assert text(events) == "t0t1t2"
    error, done = events[-2:]
    assert done == "[DONE]"
    assert error["error"]["code"] == "engine_lost", error
    assert not any(isinstance(e, dict) and e.get("usage") for e in events)
    assert not any(c.get("finish_reason") for e in events[:-2] for c in e["choices"])


@pytest.mark.parametrize("end", LOST_ENDS)
def test_a_call_that_ends_before_its_last_output_is_a_500_not_a_short_body(end):
    with pytest.raises(errors.APIError) as info:
        collect(LOST_ENDS[end]())
    assert info.value.status == 500 and info.value.code == "engine_lost"


def test_a_channelled_call_cancelled_under_its_reader_ends_the_request_instead_of_waiting():
    """Its engine request is aborted with the call, so the channel will never bring its end."""
    events = read_stream(Call([], CANCELLED_UNDER_IT()), channel_instance="replica-a/0")
    assert text(events) == "t0"
    assert events[-2]["error"]["code"] == "engine_lost" and events[-1] == "[DONE]"


def test_a_call_that_ends_with_its_last_output_is_the_whole_story():
    events = read_stream(Call([step(k) for k in range(1, NUM_TOKENS)]))
    assert text(events) == "".join(f"t{k}" for k in range(NUM_TOKENS))
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == NUM_TOKENS and events[-1] == "[DONE]"
    body = collect(Call([step(k) for k in range(1, NUM_TOKENS)]))
    assert body["choices"][0]["finish_reason"] == "length"


def test_a_reader_that_leaves_cancels_the_call_and_hears_nothing_more():
    async def go() -> tuple[Call, list[bytes]]:
        call = Call([step(1), step(2)])
        frames = stream_sse(merged(call), job(stream=True))
        got = [await frames.__anext__()]  # the first token
        await frames.aclose()  # the client went away
        return call, got

    call, got = asyncio.run(go())
    assert call.cancelled and len(got) == 1


def test_merged_outputs_that_end_with_a_choice_open_are_engine_lost():
    """The writer's own guard: whatever ended the merged outputs early, the client reads an
    error, never a usage chunk after an open choice or a body without a finish reason."""

    async def short():
        yield [(0, step(0))]

    async def stream() -> list[bytes]:
        return [frame async for frame in stream_sse(short(), job(stream=True))]

    last = json.loads(asyncio.run(stream())[-2].decode().removeprefix("data: "))
    assert last["error"]["code"] == "engine_lost"
    with pytest.raises(errors.APIError) as info:
        asyncio.run(collect_body(short(), job(stream=False)))
    assert info.value.status == 500 and info.value.code == "engine_lost"


class HangingCall(Call):
    """A Serve call still waiting for its next output when the reader leaves: it answers the
    cancel with Serve's own `RequestCancelledError`, as a handle does."""

    async def __anext__(self) -> RequestOutput:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise RequestCancelledError("r") from None
        raise AssertionError("not reached")


def test_a_reader_that_leaves_a_waiting_call_leaves_no_unretrieved_task_error():
    reported: list[dict] = []

    async def go() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: reported.append(ctx))
        frames = stream_sse(merged(HangingCall([])), job(stream=True))
        await frames.__anext__()
        await frames.aclose()  # the client went away while the call waited
        await asyncio.sleep(0.05)  # the pump ends
        gc.collect()  # an exception no one retrieved is reported when its task is collected

    asyncio.run(go())
    assert reported == []


class Stalled(Call):
    """A call that gives its outputs, then no more for `stall_s` before the rest."""

    def __init__(self, outputs: list[RequestOutput], rest: list[RequestOutput], stall_s: float):
        super().__init__(outputs)
        self.rest, self.stall_s = list(rest), stall_s

    async def __anext__(self) -> RequestOutput:
        if not self.outputs and self.rest:
            await asyncio.sleep(self.stall_s)
            self.outputs, self.rest = self.rest, []
        return await super().__anext__()


def pulls_until_end(call: Call, deadline_in_s: float) -> list[list]:
    async def go() -> list[list]:
        channels = EngineChannels(engine=None)
        box = channels.expect("r")
        deadline = time.monotonic() + deadline_in_s
        merged_ = merged_outputs([call], [box], [step(0)], deadline, channels)
        return [[(i, out and out.deltas[0].text) for i, out in ready] async for ready in merged_]

    return asyncio.run(asyncio.wait_for(go(), 5))


def test_the_deadline_ends_a_stalled_request_after_what_arrived_in_time():
    # The stall outlasts the test (the merge cancels it at the deadline); the deadline leaves
    # a loaded machine ample time to deliver the outputs before the stall.
    call = Stalled([step(1), step(2)], [step(k) for k in range(3, NUM_TOKENS)], stall_s=60.0)
    pulls = pulls_until_end(call, deadline_in_s=1.0)
    assert [t for ready in pulls[:-1] for _, t in ready] == ["t0", "t1", "t2"]
    assert pulls[-1] == [(-1, None)]  # then the deadline, once, as the last pull
    assert call.cancelled


def test_a_request_that_ends_before_its_deadline_never_sees_it():
    # A deadline far beyond the request's few microseconds, so a loaded machine cannot reach it.
    pulls = pulls_until_end(Call([step(k) for k in range(1, NUM_TOKENS)]), deadline_in_s=3.0)
    assert [t for ready in pulls for _, t in ready] == [f"t{k}" for k in range(NUM_TOKENS)]
    assert all(i == 0 for ready in pulls for i, _ in ready)
