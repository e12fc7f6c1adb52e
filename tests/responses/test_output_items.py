"""Parser events -> output items and typed events, and input items -> chat turns, without a
server: reasoning, text and calls open and close in the order the model wrote them, a call
cut short is `incomplete` and left out of the context a later response continues from."""

from __future__ import annotations

import pytest

from serve_app.errors import APIError
from serve_app.parsers.chat_output import ReasoningDelta
from serve_app.parsers.tools import ContentDelta, ToolCallArgsDelta, ToolCallStart
from serve_app.responses.chat_request import chat_messages
from serve_app.responses.output import EventNumbers, OutputItems, context_messages
from serve_app.responses.protocol import parse_body


def run(events: list, status: str = "completed") -> tuple[OutputItems, list[str]]:
    items = OutputItems()
    out = [e for event in events for e in items.add(event)]
    out += items.close(status)
    return items, [e["type"] for e in out]


def test_reasoning_then_text_then_a_call_are_three_items_in_order():
    items, types = run(
        [
            ReasoningDelta("let me "),
            ReasoningDelta("think"),
            ContentDelta("Checking."),
            ToolCallStart(0, "call_1", "get_weather"),
            ToolCallArgsDelta(0, '{"city": '),
            ToolCallArgsDelta(0, '"Oslo"}'),
        ]
    )
    assert types == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    reasoning, message, call = items.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "let me think"}]
    assert message["content"][0]["text"] == "Checking."
    assert (call["call_id"], call["arguments"], call["status"]) == (
        "call_1",
        '{"city": "Oslo"}',
        "completed",
    )
    assert context_messages(items.items) == [
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
            "reasoning_content": "let me think",
        }
    ]


def test_an_item_added_event_never_changes_with_later_deltas():
    items = OutputItems()
    added, part, delta = items.add(ContentDelta("Hi"))
    items.add(ContentDelta(" there"))
    assert added["item"]["content"] == [] and part["part"]["text"] == ""
    assert delta["delta"] == "Hi" and items.items[0]["content"][0]["text"] == "Hi there"


def test_a_call_cut_short_is_incomplete_and_not_continued_from():
    items = OutputItems()
    items.add(ToolCallStart(0, "call_1", "get_weather"))
    items.add(ToolCallArgsDelta(0, '{"city": "Os'))
    items.mark_broken([0])
    done = items.close("incomplete")
    assert done[-1]["item"]["status"] == "incomplete"
    assert context_messages(items.items) == []


def test_sequence_numbers_count_from_zero_without_gaps():
    numbers = EventNumbers()
    assert [numbers.number({})["sequence_number"] for _ in range(4)] == [0, 1, 2, 3]


def test_input_items_become_chat_turns():
    req = parse_body(
        b"""{"model": "m", "input": [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"}]}"""
    )
    assert chat_messages(req.items()) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
            "reasoning_content": "hm",
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (b'{"model": "m"}', "invalid_request", "input"),
        (b'{"model": "m", "input": "x", "metadata": {"k": 1}}', "invalid_request", "metadata.k"),
        (b'{"model": "m", "input": "x", "include": ["reasoning.encrypted_content"]}',
         "unsupported_parameter", "include"),
        (b'{"model": "m", "input": "x", "tool_choice": {"type": "web_search_preview"}}',
         "unsupported_parameter", "tool_choice.type"),
        (b'{"model": "m", "input": [{"role": "tool", "content": "x"}]}', "invalid_request",
         "input.0.role"),
    ],
)  # fmt: skip
def test_bodies_refused_before_admission(body: bytes, code: str, param: str):
    with pytest.raises(APIError) as info:
        parse_body(body).items()
    assert (info.value.code, info.value.param) == (code, param)


def test_fields_that_change_nothing_are_accepted():
    req = parse_body(
        b'{"model": "m", "input": "x", "service_tier": "auto", "prompt_cache_key": "k",'
        b' "background": false, "include": [], "user": "u-1", "store": false}'
    )
    assert req.user == "u-1" and req.store is False


@pytest.mark.parametrize(
    ("finish", "stop", "status", "reason", "code"),
    [
        ("stop", None, "completed", None, None),
        ("stop", "grammar_end", "completed", None, None),
        ("length", None, "incomplete", "max_output_tokens", None),
        ("timeout", None, "incomplete", "timeout", None),
        ("abort", "slow_consumer", "failed", None, "slow_consumer"),
        # An abort this reader did not cause is the engine dropping the response.
        ("abort", None, "failed", None, "engine_lost"),
        ("error", None, "failed", None, "engine_lost"),
    ],
)
def test_a_response_reads_its_ending_from_the_outcome_table(finish, stop, status, reason, code):
    from serve_app.responses.run import ending_of

    ending = ending_of(finish, stop)
    assert (ending.status, ending.incomplete_reason) == (status, reason)
    assert (ending.error or {}).get("code") == code
