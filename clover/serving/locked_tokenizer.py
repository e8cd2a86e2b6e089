"""The served model's tokenizer behind one lock (`LockedTokenizer`): encoding, decoding, token texts and bytes for
logprobs, the chat template it renders with, the call format that template writes, and its thinking budget."""

from __future__ import annotations

import dataclasses
import re
import threading
from typing import Any

from clover.chat_template import checkpoint_template, render_chat
from clover.engine.constraints.thinking import ThinkingBudget, thinking_budget
from clover.tool_formats import TOOL_FORMATS, detect


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character a byte-level BPE writes for each byte
    (printable Latin-1 bytes as themselves, the others shifted to 256 and up) -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(shifted)}}


_UNICODE_BYTE = _byte_alphabet()


class LockedTokenizer:
    """The tokenizer behind one lock: a fast tokenizer may refuse concurrent use from several threads (its
    Rust object is borrowed mutably when encoding), and the scheduler thread decodes for stop strings. It renders
    chats with `template` and knows the call format that template writes (`tool_format`)."""

    def __init__(self, tokenizer: Any, template: str | None = None, tool_call_parser: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.lock = threading.Lock()
        self.template = template or checkpoint_template(tokenizer)
        self.tool_format = TOOL_FORMATS[tool_call_parser] if tool_call_parser else detect(self.template)
        self._budget: ThinkingBudget | None = None  # the tags' ids and the template's closing, made on first use

    def encode(self, text: str) -> list[int]:
        with self.lock:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        with self.lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (special tokens spelled out): how logprobs name tokens."""
        with self.lock:
            return self.tokenizer.batch_decode([[i] for i in ids])

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """Each token's own bytes (logprobs' `bytes`): a byte-level token that holds part of a character decodes
        to U+FFFD, so its bytes are read from its vocabulary entry (GPT-2's byte alphabet, or a `<0xNN>` byte
        token), not from its text."""
        texts = self.token_texts(ids)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return [t.encode("utf-8") for t in texts]
        with self.lock:
            pieces = [backend.id_to_token(i) for i in ids]
        byte_level = type(backend.decoder).__name__ == "ByteLevel"
        out = []
        for text, piece in zip(texts, pieces):
            if byte_level and piece is not None and all(c in _UNICODE_BYTE for c in piece):
                out.append(bytes(_UNICODE_BYTE[c] for c in piece))
            elif piece is not None and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
                out.append(bytes([int(piece[3:5], 16)]))
            else:
                out.append(text.encode("utf-8"))
        return out

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    thinking: bool | None, template_kwargs: dict[str, Any]) -> str:
        with self.lock:
            return render_chat(self.tokenizer, messages, tools, add_generation_prompt=True, enable_thinking=thinking,
                               template=self.template, **template_kwargs)

    def thinking_budget(self, tokens: int) -> ThinkingBudget:
        """A budget of `tokens` reasoning tokens, closed with this template's own closing text
        (clover.engine.constraints.thinking)."""
        if self._budget is None:
            with self.lock:
                self._budget = thinking_budget(0, self.tokenizer, self.template)
        return dataclasses.replace(self._budget, tokens=tokens)

    def __len__(self) -> int:
        return len(self.tokenizer)

