"""Stored responses of the Responses API (`store: true`, the default): what `previous_response_id` continues and
`GET /v1/responses/{id}` returns, kept in the server's memory.

Each entry is one response's body and its whole conversation as chat messages (the input it was given, after
its own previous response's, and its answer), held as compact JSON: an entry's size is its bytes, and the store
never holds more than `capacity` bytes. Beyond that, the least recently used entries go first (reading or
continuing a response counts as a use). Nothing is written to disk: a restart forgets every response. An entry
larger than the whole store is not kept. An entry belongs to the API key that made it (`owner`: the key's index,
None without keys): for any other key it does not exist (GET, DELETE and `previous_response_id` answer 404 / 400
as for an unknown id). Event-loop only (no lock).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import Any

logger = logging.getLogger(__name__)


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # bytes; 0: nothing is kept
        self.entries: OrderedDict[str, tuple[int | None, bytes]] = OrderedDict()  # id -> (owner, entry)
        self.size = 0

    def put(self, response_id: str, response: dict[str, Any], messages: list[dict[str, Any]],
            owner: int | None = None) -> bool:
        """Keep a response of `owner` and its conversation; False when it is larger than the whole store (not
        kept)."""
        blob = json.dumps({"response": response, "messages": messages}, ensure_ascii=False,
                          separators=(",", ":")).encode()
        if len(blob) > self.capacity:
            if self.capacity:
                logger.warning("response %s not stored: %d bytes, the store holds %d", response_id, len(blob),
                               self.capacity)
            return False
        self.delete(response_id, owner)
        while self.size + len(blob) > self.capacity:
            _, (_, evicted) = self.entries.popitem(last=False)
            self.size -= len(evicted)
        self.entries[response_id] = (owner, blob)
        self.size += len(blob)
        return True

    def get(self, response_id: str, owner: int | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(the response body, its conversation as chat messages), or None when it is not (or no longer) kept, or
        not `owner`'s."""
        stored = self.entries.get(response_id)
        if stored is None or stored[0] != owner:
            return None
        self.entries.move_to_end(response_id)
        entry = json.loads(stored[1])
        return entry["response"], entry["messages"]

    def delete(self, response_id: str, owner: int | None = None) -> bool:
        """Forget `owner`'s response `response_id`; False when there is none (another key's is left alone)."""
        stored = self.entries.get(response_id)
        if stored is None or stored[0] != owner:
            return False
        del self.entries[response_id]
        self.size -= len(stored[1])
        return True

    def __len__(self) -> int:
        return len(self.entries)
