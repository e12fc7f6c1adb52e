"""What the cases read from answers: stream event order, field shapes, a cut JSON object."""

from __future__ import annotations

import pytest

from serve_app.conformance.cases.responses import event_kinds, order_problems, streamed_text
from serve_app.conformance.cases.structured import is_json_prefix
from serve_app.conformance.observe import order_violations, shape, stream_events
from serve_app.conformance.session import DONE, Stream


def chunk(index=None, role=False, content=None, finish=None, usage=None):
    choices = []
    if index is not None:
        delta = {"role": "assistant", "content": ""} if role else {}
        if content:
            delta["content"] = content
        choices.append({"index": index, "delta": delta, "finish_reason": finish})
    return {"choices": choices, "usage": usage}


IN_ORDER = [
    chunk(0, role=True), chunk(1, role=True), chunk(0, content="a"), chunk(1, content="b"),
    chunk(0, content="c"), chunk(0, finish="stop"), chunk(1, finish="length"),
    chunk(usage={"total_tokens": 3}), DONE,
]  # fmt: skip


def test_the_order_of_a_well_formed_stream_has_no_violation():
    events = stream_events(Stream(200, {}, events=IN_ORDER))
    assert events["stream"] == ["choice", "usage", DONE]
    assert events["choices"] == {"0": ["role", "delta", "finish"], "1": ["role", "delta", "finish"]}
    assert order_violations(events, chat=True, usage_asked=True) == []


@pytest.mark.parametrize(
    ("events", "after_done", "wrong"),
    [
        (IN_ORDER[:6] + [IN_ORDER[7], IN_ORDER[6], DONE], [], "stream events"),
        (IN_ORDER[2:], [], "not the role"),
        (IN_ORDER[:6] + [chunk(0, content="late")] + IN_ORDER[6:], [], "do not end with"),
        (IN_ORDER[:6] + [chunk(0, finish="stop")] + IN_ORDER[6:], [], "2 finish events"),
        (IN_ORDER, ['data: {"choices": []}'], "after [DONE]"),
    ],
)
def test_each_order_violation_is_named(events, after_done, wrong):
    stream = Stream(200, {}, events=events, after_done=after_done)
    found = order_violations(stream_events(stream), chat=True, usage_asked=True)
    assert any(wrong in message for message in found), found


def test_shape_is_field_paths_with_lists_collapsed():
    answer = {"id": "x", "choices": [{"message": {"content": "a"}}, {"message": {"role": "b"}}]}
    assert shape(answer) == [
        "choices",
        "choices[].message",
        "choices[].message.content",
        "choices[].message.role",
        "id",
    ]


@pytest.mark.parametrize(
    "text",
    ['{', '{"a', '{"a": tr', '{"a": [1, ', '{"a": 1,', '{"a": "x\\', '{"a": "\\u12',
     '{"a": 1.5e+', '{"a": {"b": nul', '{"a": 1}'],
)  # fmt: skip
def test_a_cut_json_object_is_a_prefix(text):
    assert is_json_prefix(text)


@pytest.mark.parametrize("text", ["}", '{"a" 1', '{"a": [}', '{"a": tx', "{,", '{"a": 1}}'])
def test_text_no_json_starts_with_is_not_a_prefix(text):
    assert not is_json_prefix(text)


def typed(kind: str, index: int | None = None, **fields) -> dict:
    event = {"type": f"response.{kind}", **fields}
    if index is not None:
        event["output_index"] = index
    return event


def numbered(events: list[dict]) -> list[dict]:
    return [{**e, "sequence_number": n} for n, e in enumerate(events)]


RESPONSE_STREAM = [
    typed("created"), typed("in_progress"),
    typed("output_item.added", 0), typed("content_part.added", 0),
    typed("output_text.delta", 0, delta="Hel"), typed("output_text.delta", 0, delta="lo"),
    typed("output_text.done", 0, text="Hello"), typed("content_part.done", 0),
    typed("output_item.done", 0), typed("completed"),
]  # fmt: skip


def test_a_well_formed_responses_stream_has_no_order_problem():
    events = numbered(RESPONSE_STREAM)
    assert order_problems(events) == []
    assert event_kinds(events)[4:6] == ["response.output_text.delta+", "response.output_text.done"]
    assert streamed_text(events) == ("Hello", ["Hello"])


@pytest.mark.parametrize(
    ("events", "wrong"),
    [
        (numbered(RESPONSE_STREAM[1:]), "not response.created"),
        (numbered(RESPONSE_STREAM + [typed("output_text.delta", 0)]), "terminal events"),
        (numbered(RESPONSE_STREAM[:3] + RESPONSE_STREAM[2:]), "opens before"),
        (numbered(RESPONSE_STREAM[:8] + RESPONSE_STREAM[9:]), "never closes"),
        (RESPONSE_STREAM, "sequence_numbers"),
        ([{**e, "sequence_number": n + (n > 4)} for n, e in enumerate(RESPONSE_STREAM)], "gaps"),
    ],
)
def test_a_broken_responses_stream_is_named(events, wrong):
    assert any(wrong in problem for problem in order_problems(events))
