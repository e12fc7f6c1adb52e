"""Conversations as every family uses them: read a conversation's history as chat messages,
and append items to it under the revision rule. Errors are the API's (404
`conversation_not_found`, 409 `stale_revision`), so a family only names its own param.

The revision rule: every change to a conversation's items bumps its `revision` by one; a
writer that names `expected_revision` writes only at that revision, and nobody writes while
a generation holds the next turn (that turn appends when it completes).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from serve_app import errors
from serve_app.store.base import ConversationRecord, EditOutcome, EditResult, Store
from serve_app.store.items import as_chat_messages, items_of_messages


@dataclass(frozen=True)
class History:
    """A conversation as a model input: its chat messages at `revision`."""

    conversation: ConversationRecord
    messages: list[dict[str, str]]

    @property
    def revision(self) -> int:
        return self.conversation.revision


async def read_history(
    store: Store, tenant: str, conversation_id: str, param: str = "conversation"
) -> History:
    """The conversation's items as `{"role", "content"}` chat messages, in order; 404
    `conversation_not_found` (naming `param`) when the tenant has no such conversation."""
    record = await asyncio.to_thread(store.get_conversation, tenant, conversation_id)
    if record is None:
        raise not_found(conversation_id, param)
    return History(record, as_chat_messages(record.items))


async def append_messages(
    store: Store,
    tenant: str,
    conversation_id: str,
    messages: list[dict[str, Any]],
    *,
    expected_revision: int | None,
    retention_s: float,
    param: str = "conversation",
) -> ConversationRecord:
    """Append chat messages (`{"role", "content": str}`) as message items and bump the
    revision; 404 as `read_history`, 409 `stale_revision` when `expected_revision` is not the
    current one or a generation holds the next turn (nothing is written then)."""
    return await append_items(
        store,
        tenant,
        conversation_id,
        items_of_messages(messages),
        expected_revision=expected_revision,
        retention_s=retention_s,
        param=param,
    )


async def append_items(
    store: Store,
    tenant: str,
    conversation_id: str,
    items: list[dict[str, Any]],
    *,
    expected_revision: int | None,
    retention_s: float,
    param: str = "conversation",
) -> ConversationRecord:
    """`append_messages` for items already in the stored shape (`store.items`)."""
    result = await asyncio.to_thread(
        store.append_conversation_items,
        tenant,
        conversation_id,
        items,
        expected_revision,
        time.time() + retention_s,
    )
    return applied(result, conversation_id, expected_revision, param)


def applied(
    result: EditResult, conversation_id: str, expected_revision: int | None, param: str
) -> ConversationRecord:
    """The edited conversation, or the error its outcome is."""
    if result.outcome is EditOutcome.CONVERSATION_NOT_FOUND:
        raise not_found(conversation_id, param)
    assert result.conversation is not None
    if result.outcome is EditOutcome.STALE_REVISION:
        raise stale_revision(result.conversation, expected_revision)
    if result.outcome is EditOutcome.ITEM_NOT_FOUND:
        raise errors.not_found("item_not_found", "No such item in this conversation.", "item_id")
    return result.conversation


def item_not_found(item_id: str) -> errors.APIError:
    return errors.not_found("item_not_found", f"No item '{errors.echo(item_id)}'.", "item_id")


def not_found(conversation_id: str, param: str) -> errors.APIError:
    return errors.not_found(
        "conversation_not_found", f"No conversation '{errors.echo(conversation_id)}'.", param
    )


def stale_revision(conv: ConversationRecord, expected_revision: int | None) -> errors.APIError:
    busy = " (another turn is in progress)" if conv.pending_generation else ""
    expected = (
        "" if expected_revision is None else f"; this request expected revision {expected_revision}"
    )
    return errors.conflict(
        "stale_revision",
        f"Conversation '{conv.id}' is at revision {conv.revision}{busy}{expected}.",
    )
