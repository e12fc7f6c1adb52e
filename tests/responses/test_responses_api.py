"""`/v1/responses` over HTTP with the official client on the tiny checkpoint: create,
retrieve, delete and input_items; the typed event stream and its gap-free sequence numbers;
structured output through `text.format` and `parse()`; a forced function call answered
through `previous_response_id`; what `store: false` keeps; unknown and unsupported fields."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.admin import replica_stat, wait_replica_stat

pytestmark = pytest.mark.serve

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
REPLY_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 12},
        "sure": {"type": "boolean"},
    },
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
# Item order inside one output item: added, its part, deltas, the done events.
OPENING = ("response.output_item.added", "response.content_part.added")
CLOSING = (
    "response.output_text.done",
    "response.reasoning_text.done",
    "response.function_call_arguments.done",
    "response.content_part.done",
    "response.output_item.done",
)
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


class Reply(BaseModel):
    answer: Annotated[str, Field(max_length=12)]
    sure: bool


def create(client: openai.OpenAI, model_id: str, **kwargs: Any):
    kwargs.setdefault("input", "Say hello.")
    kwargs.setdefault("max_output_tokens", 8)
    kwargs.setdefault("temperature", 0.0)
    return client.responses.create(model=model_id, **kwargs)


def error_of(r: httpx.Response) -> dict[str, Any]:
    assert r.headers["content-type"].startswith("application/json"), r.text
    return r.json()["error"]


def check_ending(response: Any, max_output_tokens: int) -> None:
    """A text response on the random tiny model either stops or uses its whole budget."""
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens <= usage.output_tokens
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
        assert usage.output_tokens == max_output_tokens
    else:
        assert response.status == "completed" and response.incomplete_details is None
        assert usage.output_tokens <= max_output_tokens


# ------------------------------------------------------------------ the resource


def test_create_retrieve_input_items_and_delete(client: openai.OpenAI, model_id: str):
    r = create(client, model_id, instructions="Be brief.", metadata={"ticket": "4411"})
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model_id
    check_ending(r, 8)
    assert r.metadata == {"ticket": "4411"} and r.instructions == "Be brief."
    assert r.store is True and r.previous_response_id is None
    assert r.to_dict()["system_fingerprint"]
    message = next(item for item in r.output if item.type == "message")
    assert r.output_text == message.content[0].text
    # Retrieve gives back exactly what create answered.
    assert client.responses.retrieve(r.id).to_dict() == r.to_dict()
    items = client.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [
        ("message", "user", "Say hello.")
    ]
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(r.id)
    assert info.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(r.id)


def test_input_items_page_in_either_order(client: openai.OpenAI, model_id: str):
    turns = [
        {"role": "user", "content": [{"type": "input_text", "text": f"turn {i}"}]} for i in range(3)
    ]
    r = create(client, model_id, input=turns, max_output_tokens=2)
    newest = client.responses.input_items.list(r.id, limit=2)
    assert [i.content[0].text for i in newest.data] == ["turn 2", "turn 1"]
    assert newest.has_more is True
    rest = client.responses.input_items.list(r.id, limit=2, after=newest.last_id)
    assert [i.content[0].text for i in rest.data] == ["turn 0"] and rest.has_more is False
    oldest = client.responses.input_items.list(r.id, order="asc")
    assert [i.content[0].text for i in oldest.data] == ["turn 0", "turn 1", "turn 2"]


def test_store_false_keeps_nothing(client: openai.OpenAI, model_id: str, serve_url: str):
    r = create(client, model_id, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    chained = httpx.post(
        f"{serve_url}/v1/responses",
        json={"model": model_id, "input": "More.", "previous_response_id": r.id},
        timeout=60,
    )
    assert chained.status_code == 404
    error = error_of(chained)
    assert (error["code"], error["param"]) == ("response_not_found", "previous_response_id")
    assert "store: false" in error["message"]


# ----------------------------------------------------------------------- streams


def read_stream(stream: Any) -> list[Any]:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in TERMINAL
    assert not any(e.type in TERMINAL for e in events[:-1])
    return events


def check_item_order(events: list[Any]) -> None:
    """Each item opens, grows and closes before the next one opens; deltas join to its text."""
    open_index = None
    texts: dict[int, str] = {}
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert open_index is None, "an item opened before the last one closed"
            open_index = e.output_index
            texts[open_index] = ""
        elif e.type.endswith(".delta"):
            assert e.output_index == open_index
            texts[open_index] += e.delta
        elif e.type == "response.output_item.done":
            assert e.output_index == open_index
            item = e.item
            done_text = item.arguments if item.type == "function_call" else item.content[0].text
            assert done_text == texts[open_index]
            open_index = None
        else:
            assert e.type in OPENING + CLOSING, e.type
            assert e.output_index == open_index
    assert open_index is None


def test_stream_events_are_ordered_numbered_and_match_the_stored_response(
    client: openai.OpenAI, model_id: str
):
    events = read_stream(create(client, model_id, stream=True, max_output_tokens=12))
    check_item_order(events)
    final = events[-1].response
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    check_ending(final, 12)
    assert events[-1].type == f"response.{final.status}"
    # The record was written before the terminal event was sent.
    assert client.responses.retrieve(final.id).to_dict() == final.to_dict()


def test_stored_responses_tokens_travel_in_the_runners_output_channel(
    client: openai.OpenAI, model_id: str, admin_url: str
):
    """A stored response's tokens after its first reach the runner in its output channel,
    one item per engine wake-up for every running response, not one Serve item per token.
    Long enough that the responses' decodes overlap: each one's admission (template, store
    writes) can take longer on a loaded machine than 16 tokens of the tiny model do, and
    responses decoded one after another share no wake-up (a CI run saw 90 outputs in 60
    items at 16)."""
    max_tokens, streams = 64, 6

    def one(i: int) -> Any:
        return create(client, model_id, input=f"Count to ten, {i}.", max_output_tokens=max_tokens)

    # The runner opens its channel to the engine replica when a request of its comes back
    # unchannelled, and a channel with no request for IDLE_S (2 s) ends: one response first,
    # so that the measured ones find it open whatever the tests before left.
    check_ending(one(-1), max_tokens)
    items_before, outputs_before = (
        replica_stat(admin_url, "channel_items"),
        replica_stat(admin_url, "channel_outputs"),
    )
    with ThreadPoolExecutor(streams) as pool:
        finals = list(pool.map(one, range(streams)))
    for final in finals:
        check_ending(final, max_tokens)
    wanted = sum(r.usage.output_tokens - 1 for r in finals)
    assert wanted >= 2 * streams  # enough tokens to tell items from outputs
    outputs = (
        wait_replica_stat(admin_url, "channel_outputs", outputs_before + wanted, timeout_s=5)
        - outputs_before
    )
    assert outputs >= wanted
    assert replica_stat(admin_url, "channel_items") - items_before < outputs / 2


def test_a_forced_function_call_streams_its_arguments(client: openai.OpenAI, model_id: str):
    events = read_stream(
        create(
            client,
            model_id,
            stream=True,
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=64,
        )
    )
    check_item_order(events)
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    jsonschema.validate(json.loads(done.arguments), WEATHER["parameters"])
    assert events[-1].type == "response.completed"


def test_the_stream_helper_accumulates_the_final_parsed_response(
    client: openai.OpenAI, model_id: str
):
    # The helper's final response needs `response.completed`: a JSON format ends the output.
    with client.responses.stream(
        model=model_id, input="Answer.", text_format=Reply, max_output_tokens=64, temperature=0.0
    ) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == deltas
    assert final.output_parsed == Reply.model_validate_json(deltas)


# ---------------------------------------------------------- structured output, tools


def test_text_format_json_schema_output_validates(client: openai.OpenAI, model_id: str):
    r = create(
        client,
        model_id,
        text={"format": {"type": "json_schema", "name": "reply", "schema": REPLY_SCHEMA,
                         "strict": True}},
        max_output_tokens=64,
    )  # fmt: skip
    assert r.status == "completed", r.to_dict()
    jsonschema.validate(json.loads(r.output_text), REPLY_SCHEMA)
    assert r.text.format.type == "json_schema" and r.text.format.name == "reply"


def test_parse_with_a_pydantic_model(client: openai.OpenAI, model_id: str):
    r = client.responses.parse(
        model=model_id, input="Answer.", text_format=Reply, max_output_tokens=64, temperature=0.0
    )
    assert r.status == "completed"
    assert isinstance(r.output_parsed, Reply)
    assert r.output_parsed == Reply.model_validate_json(r.output_text)


def test_a_forced_call_answered_through_previous_response_id(client: openai.OpenAI, model_id: str):
    first = create(
        client,
        model_id,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,  # one call, then the grammar ends the output
        max_output_tokens=128,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and calls
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    second = create(
        client, model_id, previous_response_id=first.id, input=[output], tools=[WEATHER]
    )
    assert second.previous_response_id == first.id
    check_ending(second, 8)
    # The chain is in the prompt: the first turn, the call, then the tool's output.
    assert second.usage.input_tokens > first.usage.input_tokens + len(call.arguments) // 4
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["function_call_output"]
    # The same input without the chain is a shorter prompt.
    alone = create(client, model_id, input=[output], tools=[WEATHER])
    assert alone.usage.input_tokens < second.usage.input_tokens


def test_a_response_in_a_conversation_continues_its_items_and_appends_its_own(
    client: openai.OpenAI, model_id: str, serve_url: str
):
    said = [
        {"type": "message", "role": "user", "content": "My name is Ada and I like tea."},
        {"type": "message", "role": "assistant", "content": "Hello Ada."},
    ]
    conversation = client.conversations.create(items=said)
    question = "What is my name?"
    alone = create(client, model_id, input=question)
    first = create(client, model_id, input=question, conversation=conversation.id)
    assert first.conversation.id == conversation.id and alone.conversation is None
    check_ending(first, 8)
    # The conversation's items are in the prompt, before the input.
    assert first.usage.input_tokens > alone.usage.input_tokens + 8
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [(i.type, getattr(i, "role", None)) for i in items[:3]] == [
        ("message", "user"), ("message", "assistant"), ("message", "user")
    ]  # fmt: skip
    assert items[2].content[0].text == question
    assert [i.id for i in items[3:]] == [item.id for item in first.output]
    # One revision for the turn (our extension on the conversation object).
    url = f"{serve_url}/v1/conversations/{conversation.id}"
    assert httpx.get(url, timeout=30).json()["revision"] == 1
    # The next response in it reads the turn that was added ({"id": ...} names it too).
    second = create(client, model_id, input=question, conversation={"id": conversation.id})
    assert second.usage.input_tokens > first.usage.input_tokens
    assert httpx.get(url, timeout=30).json()["revision"] == 2
    # A conversation that is gone is named.
    client.conversations.delete(conversation.id)
    with pytest.raises(openai.NotFoundError) as gone:
        create(client, model_id, input=question, conversation=conversation.id)
    assert gone.value.body["code"] == "conversation_not_found"
    assert gone.value.body["param"] == "conversation"


def test_tool_choice_none_never_calls(client: openai.OpenAI, model_id: str):
    r = create(client, model_id, tools=[WEATHER], tool_choice="none", max_output_tokens=16)
    assert all(item.type != "function_call" for item in r.output)


# --------------------------------------------------------------- refused requests


@pytest.mark.parametrize(
    ("extra", "status", "code", "param"),
    [
        ({"colour": "blue"}, 400, "unknown_parameter", "colour"),
        ({"tools": [{"type": "web_search"}]}, 400, "unsupported_parameter", "tools.0.type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs"]}]}, 400,
         "unsupported_parameter", "tools.0.type"),
        ({"background": True, "store": False}, 400, "invalid_request", "background"),
        ({"truncation": "auto"}, 400, "unsupported_parameter", "truncation"),
        ({"reasoning": {"effort": "high"}}, 400, "unsupported_parameter", "reasoning.effort"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         400, "unsupported_parameter", "input.0.content.0"),
        ({"input": [{"type": "web_search_call", "id": "ws"}]}, 400, "unsupported_parameter",
         "input.0.type"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "invalid_request",
         "input.0.call_id"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, 400,
         "invalid_request", "tool_choice.name"),
        ({"text": {"format": {"type": "json_schema", "name": "r"}}}, 400, "invalid_request",
         "text.format.schema"),
        ({"previous_response_id": "resp_never"}, 404, "response_not_found",
         "previous_response_id"),
        ({"model": "no-such-model"}, 404, "model_not_found", "model"),
        ({"conversation": "conv_x", "previous_response_id": "resp_x"}, 400, "invalid_request",
         "conversation"),
        ({"conversation": "conv_x", "store": False}, 400, "invalid_request", "store"),
        ({"conversation": {"id": "conv_never"}}, 404, "conversation_not_found", "conversation"),
        ({"max_output_tokens": 10**6}, 400, "context_length_exceeded", "input"),
    ],
)  # fmt: skip
def test_refused_requests_name_the_field(
    serve_url: str, model_id: str, extra: dict, status: int, code: str, param: str
):
    body = {"model": model_id, "input": "hi", **extra}
    r = httpx.post(f"{serve_url}/v1/responses", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = error_of(r)
    assert (error["code"], error["param"]) == (code, param), error
    assert r.headers["x-should-retry"] == "false"


def test_an_input_over_the_context_names_the_budget(serve_url: str, model_id: str):
    info = httpx.get(f"{serve_url}/v1/server_info", timeout=30).json()
    context = info["limits"]["max_model_len"]
    body = {"model": model_id, "input": "word " * (context * 2), "truncation": "disabled"}
    r = httpx.post(f"{serve_url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400
    error = error_of(r)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "input")
    assert f"maximum context length is {context} tokens" in error["message"]


def test_the_docs_sdk_example_runs_as_written(serve_url: str, capsys):
    """docs/responses.md's SDK example, pointed at this server (it needs one: not runnable)."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "responses.md").read_text()
    block = page.split("```python\n", 1)[1].split("```", 1)[0]
    assert block.startswith("import openai")
    code = block.replace("http://127.0.0.1:8000/v1", f"{serve_url}/v1")
    exec(compile(code, "docs/responses.md", "exec"), {"__name__": "docs_example"})
    assert capsys.readouterr().out.strip()


def test_server_info_lists_the_family(serve_url: str, model_id: str):
    info = httpx.get(f"{serve_url}/v1/server_info", timeout=30).json()
    family = info["responses"]
    assert {"previous_response_id", "tools", "text", "store"} <= set(family["supported_fields"])
    assert family["retention_s"] > 0 and "background" in family["supported_fields"]
    assert "background" not in family["unsupported_fields"]
    assert "conversation" in family["supported_fields"]
    assert "conversation" not in family["unsupported_fields"]
    assert {"POST /v1/responses", "POST /v1/responses/{id}/cancel"} <= set(family["routes"])
    # The conversations it continues are described too, route by route as /openapi.json has them.
    conversations = info["conversations"]
    paths = httpx.get(f"{serve_url}/openapi.json", timeout=30).json()["paths"]
    listed = {tuple(route.split(" ", 1)) for route in conversations["routes"]}
    documented = {
        (method.upper(), path)
        for path, ops in paths.items()
        if path.startswith("/v1/conversations")
        for method in ops
    }
    assert listed == documented and len(listed) == 8
    assert set(conversations["used_by"]) == {"/v1/generations", "/v1/responses"}
    rows = {row["cause"]: row["responses"] for row in info["outcomes"]}
    assert rows["max tokens"] == {"status": "incomplete", "reason": "max_output_tokens"}
