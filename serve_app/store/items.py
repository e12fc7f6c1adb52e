"""A conversation's history as OpenAI's Conversations API shows it: message items, each with
its own id, in order. The store keeps items; a family that runs on the history reads them back
as chat messages (`as_chat_messages`), and a finished turn's chat messages become items
(`message_item`)."""

from __future__ import annotations

import uuid
from typing import Any

# The part type each role's text is stored under (what OpenAI lists for that role).
TEXT_PART = {"user": "input_text", "assistant": "output_text"}


def new_item_id() -> str:
    return "msg_" + uuid.uuid4().hex


def message_item(role: str, text: str, item_id: str | None = None) -> dict[str, Any]:
    """A completed message item holding one text part."""
    part: dict[str, Any] = {"type": TEXT_PART.get(role, "input_text"), "text": text}
    if part["type"] == "output_text":
        part["annotations"] = []
    return {
        "id": item_id or new_item_id(),
        "type": "message",
        "role": role,
        "status": "completed",
        "content": [part],
    }


def item_text(item: dict[str, Any]) -> str:
    return "".join(part.get("text", "") for part in item.get("content", ()))


def as_chat_messages(items: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Message items as `{"role", "content"}` chat messages, in order."""
    return [
        {"role": item["role"], "content": item_text(item)}
        for item in items
        if item.get("type") == "message"
    ]


def items_of_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages (`{"role", "content": str}`) as new message items."""
    return [message_item(m["role"], m["content"]) for m in messages]
