"""Stored responses: what `previous_response_id` continues, and what ``GET /v1/responses/{id}``
returns and ``DELETE`` forgets.

A Responses request with `store` (true unless the client says false, as OpenAI's default is) is
kept once it has ended, completed or cut by `max_output_tokens`, together with the conversation
it ended: the items before it (its previous response's conversation), its own input items and
its output items. A later request naming it as `previous_response_id` is answered as if it had
sent that conversation followed by its own input (its `instructions` replace the earlier ones,
as OpenAI's do). Reasoning items travel along and are left out of the prompt as always; a
function call that was not a valid call is never part of the conversation. The items a stored
response brought (its output items, and its input items that came with an id) can also be named
in a later input as `{"type": "item_reference", "id": …}`, which clients that store send instead
of the item (the AI SDK does).

The store is the router process's memory: bounded by `capacity` responses and by `max_bytes` of
their own items (JSON-encoded), least recently used forgotten first, and lost on restart. A
conversation's earlier items are counted with the response that brought them; once that one is
forgotten, a later response still holds them, at most one context's worth. With several
routers behind one Service, a continuation finds its response only on the router that answered
it (the README's Responses API).
"""
from __future__ import annotations

import copy
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_BYTES = 256 << 20  # of stored items: long agent conversations sent whole are large


@dataclass(frozen=True)
class StoredResponse:
    """One ended response and the conversation it ended."""

    response: dict[str, Any]            # the Response object as last sent
    conversation: tuple[dict[str, Any], ...]  # every item so far, its output included
    own: int                            # where its own items start (those before came earlier)
    outputs: int                        # where its output items start
    size: int                           # bytes of its own items and of the response, as JSON

    @property
    def inputs(self) -> tuple[dict[str, Any], ...]:
        """What the model was given: the earlier items and its own input items."""
        return self.conversation[:self.outputs]


class ResponseStore:
    """Up to `capacity` responses and `max_bytes` by id, least recently used forgotten first
    (capacity 0: none kept).

    Conversations share their items: a chain of n turns holds each item once and n tuples of
    references, not n copies."""

    def __init__(self, capacity: int, max_bytes: int = MAX_BYTES) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        # item id → the item and how many kept responses brought it (a referenced item comes again)
        self._items: dict[str, tuple[dict[str, Any], int]] = {}

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._responses)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def item(self, item_id: str) -> dict[str, Any] | None:
        """An item a kept response brought, by its id."""
        entry = self._items.get(item_id)
        return None if entry is None else entry[0]

    def put(self, response: dict[str, Any], before: Sequence[dict[str, Any]], inputs: list[dict[str, Any]],
            outputs: list[dict[str, Any]]) -> None:
        """Keep `response` (copied: the caller's dict may change) and its conversation: the
        items `before` it (they came with an earlier response), its input and output items."""
        if not self.enabled:
            return
        size = len(json.dumps([response, inputs, outputs], ensure_ascii=False))
        self.delete(response["id"])
        stored = StoredResponse(copy.deepcopy(response), (*before, *inputs, *outputs), len(before),
                                len(before) + len(inputs), size)
        self._responses[response["id"]] = stored
        self.bytes += size
        for item in _own_items(stored):
            held = self._items.get(item["id"], (item, 0))
            self._items[item["id"]] = (held[0], held[1] + 1)
        while len(self._responses) > self.capacity or (self.bytes > self.max_bytes and len(self._responses) > 1):
            self._forget(self._responses.popitem(last=False)[1])

    def delete(self, response_id: str) -> bool:
        """Forget one; False when it is not here."""
        stored = self._responses.pop(response_id, None)
        if stored is None:
            return False
        self._forget(stored)
        return True

    def _forget(self, stored: StoredResponse) -> None:
        self.bytes -= stored.size
        for item in _own_items(stored):
            held, count = self._items[item["id"]]
            if count > 1:
                self._items[item["id"]] = (held, count - 1)
            else:
                del self._items[item["id"]]


def _own_items(stored: StoredResponse) -> list[dict[str, Any]]:
    """The items `stored` brought that have an id."""
    return [item for item in stored.conversation[stored.own:] if isinstance(item.get("id"), str)]
