"""Incremental detokenisation: text deltas from a growing list of token ids.

Decoding each new piece on its own is wrong for most tokenizers: SentencePiece drops a piece's leading space,
and byte-level BPE can split one UTF-8 character across tokens. So, like vLLM and `transformers`' TextStreamer,
decode a short window of already-emitted ids together with the new ones and emit only the text past the window's
own decoding — holding back while the text ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from typing import Callable, Iterable


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], window: int = 6) -> None:
        self.decode = decode
        self.window = window
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # ids before this have been emitted as text
        self.text = ""

    def push(self, ids: Iterable[int]) -> str:
        """Add ids; return the new text they complete (possibly empty)."""
        self.ids.extend(ids)
        prefix = self.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - self.window)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever is still held back (at the end of a request)."""
        rest = ""
        if self.read_offset < len(self.ids):  # decode the held-back ids in their window, as push does
            prefix = self.decode(self.ids[self.prefix_offset : self.read_offset])
            rest = self.decode(self.ids[self.prefix_offset :])[len(prefix) :]
        self.read_offset = len(self.ids)
        self.text += rest
        return rest
