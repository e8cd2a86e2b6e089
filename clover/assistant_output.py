"""Assistant text -> content, reasoning and tool calls (the chat template's format, `clover.chat_template`): the
one parser, for streamed and whole texts alike.

A stream cannot wait for the end: reasoning must flow as `reasoning_content` deltas before `</think>` arrives,
content must never include the start of a tag that later turns out to open a tool call, and a tool call streams as
it is written (its name, then its arguments' JSON text in fragments: `clover.tool_formats.CallDelta`, each
format's `CallParser`). `OutputParser` is a small state machine fed with text deltas that holds back only what it
must (a suffix that may be the start of a tag, trailing whitespace, a call's text that cannot be told from other
text yet). `parse_assistant_output` is the same parser fed the whole text at once, so streamed and whole responses agree by
construction (tested on random splits).

Reasoning and content are stripped, well-formed calls become calls (in the model's format, `clover.tool_formats`:
Hermes JSON or Qwen3-Coder XML in `<tool_call>` blocks, or Llama 3 JSON as the whole answer); a block that never
starts a call (not the format's call, or one that does not parse) stays in the content verbatim, a call the text
ends inside ends with what it has; an unclosed `<think>` makes the rest reasoning. Whether the text starts inside reasoning (`thinking`: the prompt opened `<think>`) a
stream must be told; a whole text may say so itself, by a `</think>` with no `<think>` before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from clover.tool_formats import CALL, END_CALL, HERMES, PYTHON_TAG, CallDelta, CallParser, ToolFormat, partial_tag

THINK, END_THINK = "<think>", "</think>"
_CONTENT, _REASONING, _CALL, _WHOLE = "content", "reasoning", "call", "whole"


@dataclass
class OutputDelta:
    """What a piece of the answer adds: content, reasoning, and pieces of tool calls (`CallDelta`s, in order)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def __add__(self, later: OutputDelta) -> OutputDelta:
        return OutputDelta(self.content + later.content, self.reasoning + later.reasoning,
                           self.tool_calls + later.tool_calls)


class _Trimmed:
    """Emits a section's text with leading and trailing whitespace removed, as `str.strip` on the whole would:
    leading whitespace is dropped, trailing whitespace is held until non-whitespace follows."""

    def __init__(self) -> None:
        self.started = False
        self.held = ""

    def push(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        return body


class OutputParser:
    """Feed text deltas; get `OutputDelta`s. `thinking`: the prompt opened `<think>` (the output starts as
    reasoning); `tools`: calls in `tool_format` become tool calls (else they are plain content); `schemas` (tool name ->
    `parameters`) types the XML format's values. In a format whose calls are the whole answer (`llama3_json`), an
    answer that starts like a call goes to the format's parser whole: its calls, or content when it is none."""

    def __init__(self, thinking: bool = False, tools: bool = False, tool_format: ToolFormat = HERMES,
                 schemas: dict[str, Any] | None = None) -> None:
        self.mode = _REASONING if thinking else _CONTENT
        self.reasoning_seen = thinking
        self.tools = tools
        self.tool_format, self.schemas = tool_format, schemas
        self.buf = ""
        self.call_parser: CallParser | None = None  # the open call block's (or the answer's) parser
        self.next_index = 0  # the index of the next call
        self.content = _Trimmed()
        self.reasoning = _Trimmed()

    def _tags(self) -> list[str]:
        if self.mode == _REASONING:
            return [END_THINK]
        return ([] if self.reasoning_seen else [THINK]) + ([CALL] if self.tools and self.tool_format.wrapped else [])

    def _emit(self, text: str, out: OutputDelta) -> None:
        if self.mode == _REASONING:
            out.reasoning += self.reasoning.push(text)
        else:
            out.content += self.content.push(text)

    def _answer_is_call(self) -> bool | None:
        """Whether the answer so far starts as a whole-answer call (None: cannot tell yet)."""
        head = self.buf.lstrip()
        if not head:
            return None
        if head.startswith(("{", PYTHON_TAG)):
            return True
        return None if PYTHON_TAG.startswith(head) else False

    def feed(self, text: str) -> OutputDelta:
        out = OutputDelta()
        self.buf += text
        while True:
            if self.mode == _WHOLE:
                out.tool_calls += self._call_parser().feed(self.buf)
                self.buf = ""
                return out
            if self.mode == _CALL:
                end = self.buf.find(END_CALL)
                if end < 0:  # feed the block what cannot be the start of its end tag
                    keep = partial_tag(self.buf, [END_CALL])
                    out.tool_calls += self._call_parser().feed(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                body, self.buf = self.buf[:end], self.buf[end + len(END_CALL):]
                out.tool_calls += self._call_parser().feed(body)
                self._close_calls(out, CALL, END_CALL)
                continue
            if (self.mode == _CONTENT and self.tools and not self.tool_format.wrapped and not self.content.started
                    and (THINK not in self.buf or self.reasoning_seen)):
                starts = self._answer_is_call()
                if starts is None:
                    return out
                if starts:
                    self.mode = _WHOLE
                    continue
            tags = self._tags()
            found = [(self.buf.find(t), t) for t in tags if t in self.buf]
            if not found:
                keep = partial_tag(self.buf, tags)
                self._emit(self.buf[: len(self.buf) - keep], out)
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            pos, tag = min(found)
            self._emit(self.buf[:pos], out)
            self.buf = self.buf[pos + len(tag):]
            if tag == THINK:
                self.mode, self.reasoning_seen = _REASONING, True
            elif tag == END_THINK:
                self.mode = _CONTENT
            else:
                self.mode = _CALL

    def _call_parser(self) -> CallParser:
        if self.call_parser is None:
            self.call_parser = self.tool_format.parser(self.schemas, self.next_index)
        return self.call_parser

    @property
    def in_call(self) -> bool:
        """Whether the text so far ends inside a call block opened by its tag (`tagged`) or an answer read as a
        whole-answer call."""
        return self.mode in (_WHOLE, _CALL)

    @property
    def tagged(self) -> bool:
        return self.mode == _CALL

    def _close_calls(self, out: OutputDelta, opening: str = "", closing: str = "", cut: bool = False) -> None:
        """End the open call block (or answer): its last deltas, or its text as content (within its tags, as
        written) when it was no call; `cut`: the text ended inside it, and a block that is no call yet is
        dropped (a cut call is never content)."""
        deltas, text = self._call_parser().close()
        self.next_index = self._call_parser().next_index
        self.call_parser, self.mode = None, _CONTENT
        out.tool_calls += deltas
        if text is not None and not cut:
            self._emit(opening + text + closing, out)

    def finish(self, cut: bool = False) -> OutputDelta:
        """The end of the text: an open call block (or answer) ends (`cut`: the length limit cut it, see
        `_close_calls`); held partial tags are text."""
        out = OutputDelta()
        rest, self.buf = self.buf, ""
        if self.mode in (_WHOLE, _CALL):
            out.tool_calls += self._call_parser().feed(rest)
            self._close_calls(out, CALL if self.mode == _CALL else "", cut=cut)
            return out
        self._emit(rest, out)
        return out


def parse_assistant_output(text: str, thinking: bool | None = None, tools: bool = True,
                           tool_format: ToolFormat = HERMES, schemas: dict[str, Any] | None = None,
                           cut: bool = False) -> tuple[str, str | None, list[dict[str, Any]]]:
    """The whole text at once: `(content, reasoning or None, tool calls)`, each call in OpenAI's form
    `{"id": "call_<i>", "type": "function", "function": {"name", "arguments": "<json>"}}`. `thinking` None: the
    text starts inside reasoning when it closes a `</think>` it did not open. `cut`: the length limit ended the
    text, so a call block it ends inside is dropped, not content (`OutputParser.finish`, as the server streams)."""
    if thinking is None:
        end = text.find(END_THINK)
        thinking = end >= 0 and THINK not in text[:end]
    parser = OutputParser(thinking, tools, tool_format, schemas)
    delta = parser.feed(text) + parser.finish(cut)
    calls = [{"id": f"call_{i}", "type": "function", "function": c} for i, c in enumerate(whole_calls(delta.tool_calls))]
    return delta.content, delta.reasoning or None, calls


def whole_calls(deltas: list[CallDelta]) -> list[dict[str, str]]:
    """The calls (`{"name", "arguments"}`, in index order) that `deltas` add up to."""
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"name": "", "arguments": ""})
        call["name"] = d.name if d.name is not None else call["name"]
        call["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]
