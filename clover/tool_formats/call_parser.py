"""Tool calls parsed as they are written: the deltas a call streams as, and the parser every format implements.

A call streams as OpenAI's chat deltas do: its start (`CallDelta.name` set: the client can show the call and its
id), then fragments of its arguments' JSON text as the model writes them, then its end (`done`). The fragments are
only text that can no longer change, so the concatenation of one call's fragments is exactly the arguments string
of the whole (non-streamed) response: both are this parser, fed once in pieces and once whole.

`CallParser` is fed the text of one call block (a wrapped format's `<tool_call>` inside) or of the whole answer (a
format whose calls are the answer), in any pieces; `close()` ends it. A parser commits to a call as soon as the
text can only be that call (Hermes: `{"name": "f", "arguments": {` is written); text that never commits is parsed
whole at the end (a call written in another key order), and when that fails too it is handed back to be shown
as content. A call the text ends inside ends with what it has (finish reason `length` tells the client).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass
class CallDelta:
    """A piece of the call at `index` (its place among the answer's calls, from 0): its start (`name` given), a
    fragment of its arguments' JSON text, its end (`done`); one delta may carry all three."""

    index: int
    name: str | None = None
    arguments: str = ""
    done: bool = False


class CallParser(ABC):
    """Text of a format's call(s) in, `CallDelta`s out. `schemas` (tool name -> its `parameters`) types what a
    format writes as text; `first_index` is the index of the first call this parser finds (calls before it were
    other blocks'); `next_index` is the index the next call after this parser's will have."""

    def __init__(self, schemas: dict[str, Any] | None = None, first_index: int = 0) -> None:
        self.schemas = schemas or {}
        self.next_index = first_index

    @abstractmethod
    def feed(self, text: str) -> list[CallDelta]:
        """What `text`, the next piece of the call's text, adds."""

    @abstractmethod
    def close(self) -> tuple[list[CallDelta], str | None]:
        """The end of the call's text: the last deltas (an unfinished call ends with what it has), and the text
        that turned out not to be calls, to be shown as content (None: all of it was)."""

    def _start(self, name: str) -> CallDelta:
        self.next_index += 1
        return CallDelta(self.next_index - 1, name=name)

    def _whole(self, calls: list[dict[str, str]]) -> list[CallDelta]:
        """Calls parsed from a whole text, as deltas: each start with its arguments and its end."""
        out = []
        for call in calls:
            delta = self._start(call["name"])
            delta.arguments, delta.done = call["arguments"], True
            out.append(delta)
        return out


def partial_tag(text: str, tags: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags` (text to hold back: it may
    be the start of a tag)."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


# -- calls written as a JSON object: {"name": "f", "<arguments key>": {...}} (Hermes, Llama 3) --------------------
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)


def json_head(text: str, keys: tuple[str, ...]) -> tuple[str, int] | bool:
    """Whether `text` opens a call head-first, `{"name": "f", "<key>": {` with `<key>` one of `keys`:
    `(name, where the arguments object starts)` once it does, True while it still may, False when it cannot."""
    steps: list[str | tuple[str, ...] | None] = ["{", ("name",), ":", None, ",", keys, ":"]  # None: the name
    at, name = 0, ""
    for step in steps:
        at = _skip_space(text, at)
        if at == len(text):
            return True
        if isinstance(step, str):  # punctuation
            if text[at] != step:
                return False
            at += 1
            continue
        match = _STRING.match(text, at)
        if match is None:  # an unfinished string: it may still be the one expected
            part = text[at:]
            return part.startswith('"') if step is None else any(json.dumps(k).startswith(part) for k in step)
        try:
            value = json.loads(match.group())
        except json.JSONDecodeError:  # a bad escape
            return False
        if step is None:
            name = value
        elif value not in step:
            return False
        at = match.end()
    at = _skip_space(text, at)
    if at == len(text):
        return True
    return (name, at) if name and text[at] == "{" else False


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


class ObjectEnd:
    """Finds where a JSON object or array written in pieces closes: the depth of brackets outside strings (escapes
    inside strings skipped). It does not check the JSON: the arguments are what the model wrote."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False

    def scan(self, text: str) -> int | None:
        """The length of `text` up to and with the closing bracket, or None when the value goes on past it."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


def canonical_call(name: Any, args: Any) -> dict[str, str] | None:
    """`{"name", "arguments": "<json object>"}` from a parsed call, or None when it is not one (arguments given as
    a JSON string are decoded)."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or not isinstance(args, dict):
        return None
    return {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}


def object_call(obj: Any, keys: tuple[str, ...]) -> dict[str, str] | None:
    """The call a parsed JSON value writes (`{"name": ..., <one of keys>: {...}}`, the first key found taken), or
    None when it is not one."""
    if not isinstance(obj, dict):
        return None
    return canonical_call(obj.get("name"), next((obj[k] for k in keys if k in obj), {}))


class JsonCall(CallParser):
    """One call written as a JSON object with its name first (`{"name": "f", "<key>": {...}}`, `keys`: the names
    the arguments may go by, the first the one to take). Once the head and the arguments' opening brace are
    written, the call starts and the arguments stream as their raw JSON text up to their closing bracket (what
    follows, the object's `}` or more, is `after`). A call written otherwise (keys in another order, arguments as
    a JSON string) is parsed whole at `close`, or handed back as text when it is not a call."""

    def __init__(self, keys: tuple[str, ...], schemas: dict[str, Any] | None = None, first_index: int = 0) -> None:
        super().__init__(schemas, first_index)
        self.keys = keys
        self.text = ""  # before the call starts (or when it cannot start head-first): all of it
        self.after = ""  # after the arguments
        self.index: int | None = None  # the call's, once started
        self.end: ObjectEnd | None = None  # while the arguments stream
        self.head_failed = False

    @property
    def arguments_done(self) -> bool:
        return self.index is not None and self.end is None

    def feed(self, text: str) -> list[CallDelta]:
        if self.arguments_done:
            self.after += text
            return []
        if self.index is None:
            self.text += text
            head = False if self.head_failed else json_head(self.text, self.keys)
            if not isinstance(head, tuple):
                self.head_failed = not head
                return []
            name, at = head
            start = self._start(name)
            self.index, self.end = start.index, ObjectEnd()
            text, self.text = self.text[at:], ""
            return [start] + self.feed(text)
        assert self.end is not None
        closed = self.end.scan(text)
        if closed is None:
            return [CallDelta(self.index, arguments=text)] if text else []
        self.end, self.after = None, text[closed:]
        return [CallDelta(self.index, arguments=text[:closed], done=True)]

    def close(self) -> tuple[list[CallDelta], str | None]:
        if self.index is None:
            calls = self.whole(self.text)
            return (self._whole(calls), None) if calls is not None else ([], self.text)
        return ([] if self.arguments_done else [CallDelta(self.index, done=True)]), None

    def whole(self, text: str) -> list[dict[str, str]] | None:
        """The call in a whole text that did not open head-first, or None."""
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return None
        call = object_call(obj, self.keys)
        return None if call is None else [call]
