"""Qwen3-Coder calls: `<tool_call>\\n<function=f>\\n<parameter=x>\\n1\\n</parameter>\\n</function>\\n</tool_call>` (Qwen3-Coder,
Qwen3.5 / 3.6, Qwen3-Next).

Every value is written as text and typed by the tool's schema (`typed_value`), so the arguments are JSON the parser
builds: the call starts at `<function=f>`; each parameter, once its `</parameter>` is written, streams as
`{"x": 1` (the first) or `, "x": 1`, except a `string` one (its schema's only type), which streams as it is
written: `{"x": "` then its characters, escaped, then `"`; `</function>` (or the block's end) closes the object with
`}`. The concatenation is `json.dumps` of the arguments (a parameter written twice keeps its first value). Text
between the parameters is ignored.
"""

from __future__ import annotations

import json
import re
from typing import Any

from clover.tool_formats.call_parser import CallDelta, CallParser, partial_tag

FUNCTION, END_FUNCTION = "<function=", "</function>"
PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"


class Qwen3CoderParser(CallParser):
    """The inside of one `<tool_call>` block."""

    def __init__(self, schemas: dict[str, Any] | None = None, first_index: int = 0) -> None:
        super().__init__(schemas, first_index)
        self.text = ""  # not yet parsed
        self.index: int | None = None  # the call's, once started
        self.properties: dict[str, Any] = {}
        self.written: set[str] = set()  # the parameters streamed so far
        self.open_key: str | None = None  # the string parameter whose value is streaming (then `text` holds
        # only what of the value was not sent: each piece is scanned once, however long the value grows)
        self.closed = False  # `</function>` written (or the block did not start with `<function=`)

    def feed(self, text: str) -> list[CallDelta]:
        self.text += text
        out: list[CallDelta] = []
        if self.closed:
            return out
        if self.index is None:
            head = self.text.lstrip()
            end = head.find(">")
            if not FUNCTION.startswith(head[:len(FUNCTION)]) or "\n" in head[:end if end >= 0 else len(head)]:
                self.closed = True  # not this format's call: handed back as text at the end
                return out
            if end < 0 or len(head) < len(FUNCTION):
                return out
            name = head[len(FUNCTION):end].strip()
            if not name:
                self.closed = True
                return out
            out.append(self._start(name))
            self.index = out[-1].index
            self.properties = (self.schemas.get(name) or {}).get("properties") or {}
            self.text = head[end + 1:]
        lead = ""  # a string value's opening, sent with its first characters
        while True:
            if self.open_key is not None:
                end = self.text.find(END_PARAMETER)
                if end < 0:  # held back: a suffix that may be the newline and tag that end the value
                    cut = len(self.text) - partial_tag(self.text, ["\n" + END_PARAMETER, END_PARAMETER])
                    fragment, self.text = lead + _escaped(self.text[:cut]), self.text[cut:]
                    if fragment:
                        out.append(CallDelta(self.index, arguments=fragment))
                    return out
                out.append(CallDelta(self.index, arguments=lead + _escaped(self.text[:end].removesuffix("\n")) + '"'))
                self.text, self.open_key, lead = self.text[end + len(END_PARAMETER):], None, ""
                continue
            param, function = self.text.find(PARAMETER), self.text.find(END_FUNCTION)
            if function >= 0 and (param < 0 or function < param):
                self.text, self.closed = "", True
                out.append(CallDelta(self.index, arguments=self._close(), done=True))
                return out
            if param < 0:
                return out
            key_end = self.text.find(">", param)
            if key_end < 0:
                return out
            key = self.text[param + len(PARAMETER):key_end].strip()
            value_end = self.text.find(END_PARAMETER, key_end)
            if value_end < 0:
                raw = self.text[key_end + 1:]
                if raw and key not in self.written and _kinds(self.properties.get(key)) == ["string"]:
                    # a string value streams as it is written (its JSON string is the escapes of its characters, one
                    # by one), from after the one newline that follows the tag
                    lead, self.open_key, self.text = self._key(key) + '"', key, raw.removeprefix("\n")
                    continue
                return out
            value = self.text[key_end + 1:value_end].removeprefix("\n").removesuffix("\n")
            self.text = self.text[value_end + len(END_PARAMETER):]
            if key not in self.written:
                value_json = json.dumps(typed_value(value, self.properties.get(key)), ensure_ascii=False)
                out.append(CallDelta(self.index, arguments=self._key(key) + value_json))

    def _key(self, key: str) -> str:
        """The fragment that opens a parameter's entry: `{"key": ` for the first, `, "key": ` after."""
        lead = ", " if self.written else "{"
        self.written.add(key)
        return f"{lead}{json.dumps(key, ensure_ascii=False)}: "

    def _close(self) -> str:
        return "}" if self.written else "{}"

    def close(self) -> tuple[list[CallDelta], str | None]:
        if self.index is None:
            return [], self.text
        if self.closed:
            return [], None
        # the block ended without `</function>`: its complete parameters are the call's, and a string value being
        # written ends with what was sent of it
        self.closed = True
        rest = '"' if self.open_key is not None else ""
        return [CallDelta(self.index, arguments=rest + self._close(), done=True)], None


def _escaped(text: str) -> str:
    """`text` inside a JSON string, without the quotes."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _kinds(schema: Any) -> list[str]:
    """The JSON types a parameter's schema allows (none: untyped)."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    return [kinds] if isinstance(kinds, str) else list(kinds or [])


def typed_value(text: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema's type calls for (the text itself when it does not fit)."""
    kinds = _kinds(schema)
    if kinds == ["string"]:
        return text
    stripped = text.strip()
    for kind in kinds:
        if kind == "integer" and re.fullmatch(r"-?\d+", stripped):
            return int(stripped)
        if kind == "number":
            try:
                number = float(stripped)
            except ValueError:
                continue
            return int(number) if number.is_integer() and re.fullmatch(r"-?\d+", stripped) else number
        if kind == "boolean" and stripped.lower() in ("true", "false"):
            return stripped.lower() == "true"
        if kind == "null" and stripped.lower() in ("null", "none"):
            return None
        if kind in ("object", "array"):
            try:
                value = json.loads(stripped)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict if kind == "object" else list):
                return value
    if "string" in kinds:
        return text
    if not kinds:  # untyped: JSON when it parses as such
        try:
            return json.loads(stripped)
        except json.JSONDecodeError:
            return text
    return text
