"""A stream's pending tokens leave as one SSE event when the writer fell behind, and one token
per event while it keeps up; either way the client reads the same text, token ids, logprobs,
finish reason and usage, in the same event order (seed 000: fragmentation changes chunking,
never meaning). Driven through the ingress's own merge of engine outputs (`merged_outputs`)
and SSE writer, with engine streams the test paces."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from actors.messages import TokenLogprobs
from actors.outputs import CompletionDelta, RequestOutput
from actors.request import FinishReason
from serve_app.openai.admission import AdmittedRequest
from serve_app.openai.format import Formatter
from serve_app.openai.stream import coalesced, stream_sse
from serve_app.openai.token_text import TokenTexts
from serve_app.parsers.chat_output import ReasoningDelta
from serve_app.parsers.tools import ContentDelta, ToolCallArgsDelta, ToolCallStart
from serve_app.protocol import (
    ChatChunkChoice,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    parse_request,
)
from serve_app.workers.merged_outputs import merged_outputs
from serve_app.workers.output_channel import EngineChannels, Routed

PROMPT_IDS = [1, 2, 3]
NUM_TOKENS = 24
WORDS = ["é", " the", " cat", "", " sat", " on", " mat", "\n"]  # "" : a held-back piece


class PieceTokenizer:
    """The two calls TokenTexts makes: token `i` is the piece `p<i>`."""

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return f"p{token_id}"

    def decode(self, token_ids: list[int]) -> str:
        return "".join(f"p{t}" for t in token_ids)


def job(chat: bool, n: int = 1) -> AdmittedRequest:
    common = {"model": "m", "stream": True, "n": n, "stream_options": {"include_usage": True}}
    if chat:
        body = {**common, "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
        body["top_logprobs"] = 2
    else:
        body = {**common, "prompt": "hi", "logprobs": 2, "return_token_ids": True}
    req = parse_request("chat" if chat else "completion", body)
    fmt = Formatter(
        chat=chat, response_id="cmpl-1", model="m", fingerprint="fp",
        texts=TokenTexts(PieceTokenizer()), want_logprobs=True, want_token_ids=not chat,
        prompt_ids=[PROMPT_IDS], n=n,
    )  # fmt: skip
    engine_request = SimpleNamespace(prompt_token_ids=PROMPT_IDS)
    return AdmittedRequest(req, fmt, [engine_request], [""], n, None)


def outputs(n: int = 1) -> list[RequestOutput]:
    """One engine output per step, each one token per choice; the last ends every choice."""
    steps = []
    for k in range(NUM_TOKENS):
        last = k == NUM_TOKENS - 1
        deltas = [
            CompletionDelta(
                index=c,
                token_ids=[100 + 10 * c + k],
                text=WORDS[(k + c) % len(WORDS)],
                logprobs=[TokenLogprobs(-0.5 - k / 10, 1, [(100 + k, -0.5), (7, -2.0 - c)])],
                finish_reason=FinishReason.LENGTH if last else None,
            )
            for c in range(n)
        ]
        steps.append(RequestOutput("r", PROMPT_IDS, deltas, 2, last))
    return steps


class PacedStream:
    """An engine call's later outputs, as the test puts them."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[RequestOutput | None] = asyncio.Queue()

    def __aiter__(self) -> PacedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        out = await self.queue.get()
        if out is None:
            raise StopAsyncIteration
        return out

    def cancel(self) -> None:
        pass


def decode(frame: bytes) -> dict | str:
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    data = frame[len(b"data: ") : -2].decode()
    return data if data == "[DONE]" else json.loads(data)


async def read(chat: bool, lag: int, n: int = 1) -> list[dict | str]:
    """The SSE events of one stream whose reader lets `lag` engine outputs arrive before each
    next read (0: it reads each output as soon as it is there)."""
    steps = outputs(n)
    stream = PacedStream()
    channels = EngineChannels(engine=None)
    box = channels.expect("r")
    merged = merged_outputs([stream], [box], [steps[0]], None, channels)
    events, produced = [], 1

    async def produce() -> None:
        nonlocal produced
        for out in steps[1:]:
            stream.queue.put_nowait(out)
            produced += 1
            while lag == 0 and num_read_tokens(events) < produced:
                await asyncio.sleep(0)  # the reader keeps up: it has read this output
            await asyncio.sleep(0)
        stream.queue.put_nowait(None)

    producer = asyncio.create_task(produce())
    async for frame in stream_sse(merged, job(chat, n)):
        events.append(decode(frame))
        target = min(NUM_TOKENS, num_read_tokens(events) + lag)
        while lag and produced < target:
            await asyncio.sleep(0)  # the reader is busy: outputs pile up in the ingress
    await producer
    return events


def chunk_token_ids(event: dict | str) -> list[int]:
    """The generated ids an event carries (chat reads them off its logprobs)."""
    if not isinstance(event, dict) or not event.get("choices"):
        return []
    ids = []
    for choice in event["choices"]:
        if "token_ids" in choice:
            ids += choice["token_ids"]
        elif choice.get("logprobs"):
            ids += [int(lp["token"][1:]) for lp in choice["logprobs"]["content"]]
    return ids


def num_read_tokens(events: list) -> int:
    return sum(len(chunk_token_ids(e)) for e in events)


def story(events: list[dict | str], chat: bool) -> dict:
    """What a client reads out of a stream, whatever its chunking."""
    text: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    logprobs: dict[int, list] = {}
    finish: dict[int, str] = {}
    for event in events:
        if not isinstance(event, dict):
            continue
        for choice in event["choices"]:
            i = choice["index"]
            piece = choice["delta"].get("content") if chat else choice["text"]
            text[i] = text.get(i, "") + (piece or "")
            ids.setdefault(i, []).extend(choice.get("token_ids") or [])
            lp = choice.get("logprobs")
            if lp:
                per_token = lp["content"] if chat else list(zip(*lp.values(), strict=True))
                logprobs.setdefault(i, []).extend(per_token)
            if choice["finish_reason"]:
                finish[i] = choice["finish_reason"]
    usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    return {"text": text, "ids": ids, "logprobs": logprobs, "finish": finish, "usage": usage}


def kinds(events: list[dict | str]) -> list[str]:
    """Each event's place in the promised order, runs of content collapsed to one."""
    out: list[str] = []
    for event in events:
        if event == "[DONE]":
            kind = "done"
        elif not event["choices"]:
            kind = "usage"
        elif event["choices"][0]["finish_reason"]:
            kind = "finish"
        elif event["choices"][0].get("delta", {}).get("role"):
            kind = "role"
        elif "prompt_token_ids" in event["choices"][0]:
            kind = "echo"
        else:
            kind = "content"
        if not out or out[-1] != kind or kind != "content":
            out.append(kind)
    return out


def content_events(events: list[dict | str]) -> list[dict]:
    return [e for e in events if chunk_token_ids(e)]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_reader_that_keeps_up_gets_one_token_per_event(chat):
    events = asyncio.run(read(chat, lag=0))
    per_event = [len(chunk_token_ids(e)) for e in content_events(events)]
    assert per_event == [1] * NUM_TOKENS


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_slow_reader_gets_fewer_events_that_tell_the_same_story(chat):
    fast = asyncio.run(read(chat, lag=0))
    slow = asyncio.run(read(chat, lag=5))
    per_event = [len(chunk_token_ids(e)) for e in content_events(slow)]
    assert sum(per_event) == NUM_TOKENS
    assert len(per_event) < NUM_TOKENS and max(per_event) > 1, per_event
    assert story(slow, chat) == story(fast, chat)
    assert story(fast, chat)["usage"][0]["completion_tokens"] == NUM_TOKENS
    # The held-back piece ("") and the multi-byte one pass through unchanged.
    assert story(fast, chat)["text"][0].startswith("é the cat sat")
    expected = ["role" if chat else "echo", "content", "finish", "usage", "done"]
    assert kinds(slow) == kinds(fast) == expected


def test_choices_coalesce_apart_and_keep_their_own_order():
    fast = asyncio.run(read(True, lag=0, n=2))
    slow = asyncio.run(read(True, lag=6, n=2))
    assert story(slow, True) == story(fast, True)
    assert sorted(story(slow, True)["finish"].items()) == [(0, "length"), (1, "length")]
    assert len(content_events(slow)) < len(content_events(fast))
    for event in content_events(slow):
        assert len(event["choices"]) == 1


def test_a_channel_batch_of_one_request_leaves_as_one_event():
    """The engine replica's channel delivers several steps of a request in one item (its
    reader lagged): those outputs are pending in the ingress together."""
    steps = outputs()

    async def go() -> list[dict | str]:
        channels = EngineChannels(engine=None)
        box = channels.expect("r")
        channels.routed(box, Routed("replica-1", "replica-1/0", steps[0]))
        call = PacedStream()
        call.queue.put_nowait(None)  # a channelled call yields nothing more
        merged = merged_outputs([call], [box], [steps[0]], None, channels)
        frames = stream_sse(merged, job(chat=False))
        events = [decode(await frames.__anext__())]  # the echo chunk
        events.append(decode(await frames.__anext__()))  # the first token
        for out in steps[1:]:  # one channel batch
            box.put(out)
        events += [decode(frame) async for frame in frames]
        return events

    events = asyncio.run(go())
    assert [len(chunk_token_ids(e)) for e in content_events(events)] == [1, NUM_TOKENS - 1]
    assert story(events, False) == story(asyncio.run(read(False, lag=0)), False)


def test_completions_offsets_are_those_of_the_one_token_events():
    fast = story(asyncio.run(read(False, lag=0)), False)
    slow = story(asyncio.run(read(False, lag=7)), False)
    # (token, logprob, top, text_offset) per token, concatenated across events.
    assert [t[3] for t in slow["logprobs"][0]] == [t[3] for t in fast["logprobs"][0]]


def test_like_parser_events_join_and_a_call_start_stays_its_own():
    events = [
        ContentDelta("a"),
        ContentDelta("b"),
        ReasoningDelta("r"),
        ReasoningDelta("s"),
        ToolCallStart(0, "call-0", "f"),
        ToolCallArgsDelta(0, '{"x'),
        ToolCallArgsDelta(0, '":1}'),
        ToolCallStart(1, "call-1", "g"),
        ToolCallArgsDelta(1, "{}"),
        ContentDelta("c"),
    ]
    assert coalesced(events) == [
        ContentDelta("ab"),
        ReasoningDelta("rs"),
        ToolCallStart(0, "call-0", "f"),
        ToolCallArgsDelta(0, '{"x":1}'),
        ToolCallStart(1, "call-1", "g"),
        ToolCallArgsDelta(1, "{}"),
        ContentDelta("c"),
    ]


def test_the_per_token_choices_are_the_wire_form_of_the_protocol_models():
    """The hot path builds chunk choices as dicts: they equal what the typed models send."""
    chat = job(chat=True).formatter
    lp = ChatLogprobs(content=[ChatTokenLogprob.build("p5", -0.25, [("p5", -0.25)])])
    events = [ContentDelta("hé"), ReasoningDelta("why"), ToolCallStart(0, "c0", "f")]
    events.append(ToolCallArgsDelta(0, '{"a":1}'))
    got = chat.event_choices(2, events, [5], lp.to_dict())
    models = [
        ChatChunkChoice(index=2, delta=DeltaMessage(content="hé"), logprobs=lp),
        ChatChunkChoice(index=2, delta=DeltaMessage(reasoning_content="why")),
        ChatChunkChoice(
            index=2,
            delta=DeltaMessage(
                tool_calls=[
                    DeltaToolCall(
                        index=0,
                        id="c0",
                        type="function",
                        function=DeltaFunctionCall(name="f", arguments=""),
                    )
                ]
            ),
        ),
        ChatChunkChoice(
            index=2,
            delta=DeltaMessage(
                tool_calls=[DeltaToolCall(index=0, function=DeltaFunctionCall(arguments='{"a":1}'))]
            ),
        ),
    ]
    assert got == [m.to_dict() for m in models]
    assert chat.event_choices(0, [], [5], lp.to_dict()) == [
        ChatChunkChoice(index=0, delta=DeltaMessage(), logprobs=lp).to_dict()
    ]
    completions = job(chat=False).formatter
    assert completions.text_choice(1, "hi", [5, 6], None) == (
        CompletionChoice(index=1, text="hi", token_ids=[5, 6]).to_dict()
    )
    # The envelope is the typed chunk's, with the choice in its place.
    frame = decode(completions.frames.frame(completions.text_choice(0, "x", [5], None)))
    typed = completions._chunk([CompletionChoice(index=0, text="x", token_ids=[5])])
    assert frame == typed
