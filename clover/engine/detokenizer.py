"""Incremental detokenisation: text deltas from a growing list of token ids.

Decoding each new piece on its own is wrong for most tokenizers: SentencePiece drops a piece's leading space,
and byte-level BPE can split one UTF-8 character across tokens. So, like vLLM and `transformers`' TextStreamer,
decode a short window of already-emitted ids together with the new ones and emit only the text past the window's
own decoding — holding back while the text ends in an incomplete character (U+FFFD).

`StopAwareDetokenizer` adds what a front end streaming to a user needs on top: stop strings are excluded from the
output (as OpenAI does), so the tail that may still grow into one is held back until the next piece or the end.
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


class StopAwareDetokenizer:
    """One request's output text for streaming, cut before the stop string that ended it.

    The engine decides where a request stops (`Sequence` ends it after the token that completes a stop string) and
    reports which string in `stats["stop_string"]`; this trims the text to match. Until the end, the last
    `max(len(stop)) - 1` characters are held back: they may be the start of a stop string completed by the next
    piece, and text once sent cannot be taken back.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: Iterable[str] = ()) -> None:
        self.detok = IncrementalDetokenizer(decode)
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""  # emitted so far; once finished, the whole output

    def push(self, ids: Iterable[int], finished: bool = False, stop_string: str | None = None) -> str:
        """Add one piece's ids; return the text now safe to emit (possibly empty). On the request's last piece
        (`finished`), release everything held back, cut before `stop_string` if the request ended on it."""
        self.detok.push(ids)
        if finished:
            self.detok.flush()
        full = self.detok.text
        if finished and stop_string and stop_string in full:
            full = full[: full.index(stop_string)]
        upto = len(full) if finished else len(full) - self.hold
        delta = full[len(self.text) : max(len(self.text), upto)]
        self.text += delta
        return delta
