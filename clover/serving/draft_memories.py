"""Whose answers draft whose: the server's drafting memories (clover.engine.drafts.draft_memory), by API key.

A draft never changes an answer (exact mode verifies it), but its speed can: a client whose request decodes
unusually fast learns that the server has written that text before, perhaps for another client. So by default
each API key has its own memory (`per-key`; without keys every request shares one), `shared` pools every answer
(the most drafts, for a server whose clients trust each other), and `off` drafts from the request's own context
only. Each memory holds at most `capacity` tokens, so the server keeps at most `capacity` tokens per key.

The key a request came with is the middleware's to know: it sets `CLIENT_KEY` (clover.serving.request_context)
in the request's context, where the route that submits the request reads it.
"""

from __future__ import annotations

import threading

from clover.engine.drafts.draft_memory import DraftMemory
from clover.serving.request_context import CLIENT_KEY


class DraftMemories:
    """The memories of one server (module docstring): `mode` one of `clover.choices.DRAFT_MEMORY_MODES` and
    `capacity` tokens a memory, as `ServerOptions` checked them."""

    def __init__(self, mode: str, capacity: int) -> None:
        self.mode, self.capacity = mode, capacity
        self._by_key: dict[int | None, DraftMemory] = {}
        self._lock = threading.Lock()

    def for_request(self) -> DraftMemory | None:
        """The memory the current request drafts from and joins (None: `off`)."""
        if self.mode == "off":
            return None
        key = CLIENT_KEY.get() if self.mode == "per-key" else None
        with self._lock:
            memory = self._by_key.get(key)
            if memory is None:
                memory = self._by_key[key] = DraftMemory(self.capacity)
            return memory

    def tokens_of(self, key: int | None) -> int:
        """Tokens held by the memory the requests of API key `key` draft from (0: `off`)."""
        with self._lock:
            memory = self._by_key.get(key if self.mode == "per-key" else None) if self.mode != "off" else None
        return len(memory) if memory is not None else 0

    def tokens(self) -> int:
        """Tokens held, over every memory."""
        with self._lock:
            memories = list(self._by_key.values())
        return sum(len(m) for m in memories)
