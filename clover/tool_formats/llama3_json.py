"""Llama 3 calls: the whole answer is `{"name": "f", "parameters": {...}}` (`<|python_tag|>` allowed first; several
calls separated by `;`), Llama 3.1 / 3.2 / 3.3.

Each call streams as a Hermes call does (`JsonCall`, its arguments under `parameters`, or `arguments`). After a
call, `;` starts the next; anything else ends the stream of calls: the rest is held to the end, then parsed whole as
calls, or handed back as content when it is not.
"""

from __future__ import annotations

import json
from typing import Any

from clover.tool_formats.call_parser import CallDelta, CallParser, JsonCall, ObjectEnd, object_call

PYTHON_TAG = "<|python_tag|>"
KEYS = ("parameters", "arguments")


class Llama3Parser(CallParser):
    """The whole answer, once it starts like a call (`{` or `<|python_tag|>`)."""

    def __init__(self, schemas: dict[str, Any] | None = None, first_index: int = 0) -> None:
        super().__init__(schemas, first_index)
        self.first_index = first_index
        self.answer = ""  # the text until a call starts (parsed whole, or content, when none does)
        self.call: JsonCall | None = None  # the call being written, once past the python tag
        self.rest: str | None = None  # the text after the streamed calls that is not one, held to the end

    @property
    def streamed(self) -> bool:
        return self.next_index > self.first_index

    def feed(self, text: str) -> list[CallDelta]:
        if not self.streamed:
            self.answer += text
        if self.rest is not None:
            self.rest += text
            return []
        if self.call is None:
            head = self.answer.lstrip()
            if PYTHON_TAG.startswith(head):
                return []
            self.call, text = JsonCall(KEYS, self.schemas, self.next_index), head.removeprefix(PYTHON_TAG)
        out = self._feed_call(text)
        while self.rest is None and self.call.arguments_done:
            closed = _object_rest(self.call.after)
            after = "" if closed is None else self.call.after[closed:].lstrip()
            if not after:  # the call object's other keys, its closing brace, and maybe the separator, still to come
                break
            if not after.startswith(";"):
                self.rest = after
                break
            self.call = JsonCall(KEYS, self.schemas, self.next_index)
            out += self._feed_call(after[1:])
        return out

    def _feed_call(self, text: str) -> list[CallDelta]:
        assert self.call is not None
        was_streamed = self.streamed
        out = self.call.feed(text)
        self.next_index = self.call.next_index
        if self.call.head_failed and was_streamed:  # a later call not written head-first: parsed at the end
            self.rest = self.call.text
        return out

    def close(self) -> tuple[list[CallDelta], str | None]:
        if self.rest is not None or not self.streamed:
            text = self.rest if self.rest is not None else self.answer
            calls = parse_calls(text)
            return (self._whole(calls), None) if calls is not None else ([], text or None)
        assert self.call is not None
        out, text = self.call.close()
        self.next_index = self.call.next_index
        return out, text


def _object_rest(text: str) -> int | None:
    """Where the call object closes in `text`, what follows its arguments (other keys may come before its `}`), or
    None while it is open."""
    end = ObjectEnd()
    end.depth = 1  # inside the call object
    return end.scan(text)


def parse_calls(text: str) -> list[dict[str, str]] | None:
    """The calls (`{"name", "arguments"}`) of a whole text of `;`-separated call objects, or None."""
    text = text.strip().removeprefix(PYTHON_TAG).strip()
    if not text.startswith("{"):
        return None
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            obj, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        call = object_call(obj, KEYS)
        if call is None:
            return None
        calls.append(call)
        rest = text[end:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        at = len(text) - len(rest[1:].lstrip())
    return calls or None
