"""What the cases read from answers: stream event order, field shapes, a cut JSON object."""

from __future__ import annotations

import pytest

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
