"""OpenAI's list page over a resource's items (a conversation's items, a response's input
items): newest first unless `order=asc`, `limit` per page (1 to 100, 20 by default), paged by
`after` (an item id), in the shape `{"object": "list", "data", "first_id", "last_id",
"has_more"}`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from serve_app import errors

MAX_LIST_LIMIT = 100
DEFAULT_LIST_LIMIT = 20


def item_list(items: list[dict[str, Any]], has_more: bool = False) -> dict[str, Any]:
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }


def item_page(items: list[dict[str, Any]], params: Mapping[str, str], what: str) -> dict:
    """The page of `items` (oldest first) the query `params` ask for; a bad `order`, `limit`
    or an `after` that names no item is 400 naming it (`what` names the items)."""
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise errors.invalid_request("'order' is 'asc' or 'desc'.", "order")
    limit = list_limit(params.get("limit"))
    items = list(reversed(items)) if order == "desc" else list(items)
    after = params.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise errors.invalid_request(f"No {what} '{errors.echo(after)}'.", "after")
        items = items[ids.index(after) + 1 :]
    return item_list(items[:limit], has_more=len(items) > limit)


def list_limit(value: str | None) -> int:
    if value is None:
        return DEFAULT_LIST_LIMIT
    try:
        limit = int(value)
    except ValueError:
        raise errors.invalid_request("'limit' is an integer.", "limit") from None
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise errors.invalid_request(f"'limit' is 1 to {MAX_LIST_LIMIT}.", "limit")
    return limit
