"""Stored responses of the Responses API (`store: true`, the default): what `previous_response_id` continues and
`GET /v1/responses/{id}` returns, kept in the server's memory.

Each entry is one response's body and its whole conversation as chat messages (the input it was given, after
its own previous response's, and its answer), held as compact JSON: an entry's size is its bytes, and the store
never holds more than `capacity` bytes. Beyond that, the least recently used entries go first (reading or
continuing a response counts as a use). Nothing is written to disk: a restart forgets every response. An entry
larger than the whole store is not kept. Event-loop only (no lock).
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
        self.entries: OrderedDict[str, bytes] = OrderedDict()
        self.size = 0

    def put(self, response_id: str, response: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
        """Keep a response and its conversation; False when it is larger than the whole store (not kept)."""
        blob = json.dumps({"response": response, "messages": messages}, ensure_ascii=False,
                          separators=(",", ":")).encode()
        if len(blob) > self.capacity:
            if self.capacity:
                logger.warning("response %s not stored: %d bytes, the store holds %d", response_id, len(blob),
                               self.capacity)
            return False
        self.delete(response_id)
        while self.size + len(blob) > self.capacity:
            _, evicted = self.entries.popitem(last=False)
            self.size -= len(evicted)
        self.entries[response_id] = blob
        self.size += len(blob)
        return True

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        """(the response body, its conversation as chat messages), or None when it is not (or no longer) kept."""
        blob = self.entries.get(response_id)
        if blob is None:
            return None
        self.entries.move_to_end(response_id)
        entry = json.loads(blob)
        return entry["response"], entry["messages"]

    def delete(self, response_id: str) -> bool:
        blob = self.entries.pop(response_id, None)
        if blob is None:
            return False
        self.size -= len(blob)
        return True

    def __len__(self) -> int:
        return len(self.entries)
