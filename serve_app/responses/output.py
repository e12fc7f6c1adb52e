"""Parser events -> Responses output items, and the typed stream events each step adds.

One `OutputItems` per response: the chat parsers' events (reasoning, content, tool-call
starts and argument fragments, in token order) open and fill items in the order the model
wrote them: a `reasoning` item for the `<think>` span, a `message` with one `output_text`
part, a `function_call` per call. Each item opens with `response.output_item.added` (and its
content part), grows by deltas, and closes with its `.done` events before the next opens, so
the streamed events and the final `output` are one fold of one sequence. Events carry no
`sequence_number` here: the writer numbers every frame it sends (`EventNumbers`).
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass, field
from typing import Any

from serve_app.parsers.chat_output import OutputEvent, ReasoningDelta
from serve_app.parsers.tools import ContentDelta, ToolCallArgsDelta, ToolCallStart

Event = dict[str, Any]


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class OpenItem:
    item: dict[str, Any]
    output_index: int
    kind: str  # "message" | "reasoning" | "function_call"
    call_index: int | None = None  # the parser's index of a function call


@dataclass
class OutputItems:
    items: list[dict[str, Any]] = field(default_factory=list)
    current: OpenItem | None = None
    # Parser call index -> output index, for argument fragments.
    calls: dict[int, int] = field(default_factory=dict)

    def add(self, event: OutputEvent) -> list[Event]:
        if isinstance(event, ReasoningDelta):
            return self._text("reasoning", event.text)
        if isinstance(event, ContentDelta):
            return self._text("message", event.text)
        if isinstance(event, ToolCallStart):
            out = self.close("completed")
            item = {
                "id": new_item_id("fc"),
                "type": "function_call",
                "call_id": event.id,
                "name": event.name,
                "arguments": "",
                "status": "in_progress",
            }
            self.current = OpenItem(item, len(self.items), "function_call", event.index)
            self.items.append(item)
            self.calls[event.index] = self.current.output_index
            return [*out, self._added()]
        assert isinstance(event, ToolCallArgsDelta)
        index = self.calls[event.index]
        self.items[index]["arguments"] += event.fragment
        return [
            {
                "type": "response.function_call_arguments.delta",
                "item_id": self.items[index]["id"],
                "output_index": index,
                "delta": event.fragment,
            }
        ]

    def _text(self, kind: str, text: str) -> list[Event]:
        out: list[Event] = []
        if self.current is None or self.current.kind != kind:
            out += self.close("completed")
            out += self._open_text(kind)
        assert self.current is not None
        self.current.item["content"][0]["text"] += text
        delta = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        event: Event = {
            "type": delta,
            "item_id": self.current.item["id"],
            "output_index": self.current.output_index,
            "content_index": 0,
            "delta": text,
        }
        if kind == "message":
            event["logprobs"] = []
        return [*out, event]

    def _open_text(self, kind: str) -> list[Event]:
        if kind == "message":
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
            item = {
                "id": new_item_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [part],
            }
        else:
            part = {"type": "reasoning_text", "text": ""}
            item = {
                "id": new_item_id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [part],
                "status": "in_progress",
            }
        self.current = OpenItem(item, len(self.items), kind)
        self.items.append(item)
        added = self._added()
        added["item"]["content"] = []  # the part arrives in its own event
        return [
            added,
            {
                "type": "response.content_part.added",
                "item_id": item["id"],
                "output_index": self.current.output_index,
                "content_index": 0,
                "part": copy.deepcopy(part),
            },
        ]

    def _added(self) -> Event:
        assert self.current is not None
        return {
            "type": "response.output_item.added",
            "output_index": self.current.output_index,
            "item": copy.deepcopy(self.current.item),
        }

    def close(self, status: str) -> list[Event]:
        """Close the open item (`completed`, or `incomplete` when the output was cut)."""
        current, self.current = self.current, None
        if current is None:
            return []
        item = current.item
        item["status"] = status
        where = {"item_id": item["id"], "output_index": current.output_index}
        out: list[Event] = []
        if current.kind == "function_call":
            out.append(
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        else:
            part = item["content"][0]
            done = (
                "response.output_text.done"
                if current.kind == "message"
                else ("response.reasoning_text.done")
            )
            text_done: Event = {"type": done, **where, "content_index": 0, "text": part["text"]}
            if current.kind == "message":
                text_done["logprobs"] = []
            out.append(text_done)
            out.append(
                {
                    "type": "response.content_part.done",
                    **where,
                    "content_index": 0,
                    "part": copy.deepcopy(part),
                }
            )
        out.append(
            {
                "type": "response.output_item.done",
                "output_index": current.output_index,
                "item": copy.deepcopy(item),
            }
        )
        return out

    def mark_broken(self, call_indices: list[int]) -> None:
        """Calls the parser found cut short (max tokens): `incomplete`, never `completed`."""
        for index in call_indices:
            if index in self.calls:
                self.items[self.calls[index]]["status"] = "incomplete"


class EventNumbers:
    """Gap-free `sequence_number`s over one stream's events, from 0."""

    def __init__(self) -> None:
        self.next = 0

    def number(self, event: Event) -> Event:
        event["sequence_number"] = self.next
        self.next += 1
        return event


def usage(
    input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int
) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def context_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat turn a later response continues from: its text,
    reasoning and well-formed calls (a call cut short is left out)."""
    content = "".join(
        part["text"] for item in items if item["type"] == "message" for part in item["content"]
    )
    reasoning = "".join(
        part["text"] for item in items if item["type"] == "reasoning" for part in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in items
        if item["type"] == "function_call" and item["status"] == "completed"
    ]
    if not (content or calls):
        return []
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return [message]
