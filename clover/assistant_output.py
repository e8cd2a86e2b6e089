"""Assistant text -> content, reasoning and tool calls (the chat template's format, `clover.chat_template`): the
one parser, for streamed and whole texts alike.

A stream cannot wait for the end: reasoning must flow as `reasoning_content` deltas before `</think>` arrives,
content must never include the start of a tag that later turns out to open a tool call, and a tool call can only
be emitted once its JSON is complete. `OutputParser` is a small state machine fed with text deltas that holds back
only what it must (a suffix that may be the start of a tag, trailing whitespace, an unfinished tool call).
`parse_assistant_output` is the same parser fed the whole text at once, so streamed and whole responses agree by
construction (tested on random splits).

Reasoning and content are stripped, well-formed calls become calls (in the model's format, `clover.tool_formats`:
Hermes JSON or Qwen3-Coder XML in `<tool_call>` blocks, or Llama 3 JSON as the whole answer), malformed or
unclosed ones stay in the content verbatim, an unclosed `<think>`
makes the rest reasoning. Whether the text starts inside reasoning (`thinking`: the prompt opened `<think>`) a
stream must be told; a whole text may say so itself, by a `</think>` with no `<think>` before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from clover.tool_formats import CALL, END_CALL, HERMES, PYTHON_TAG, ToolFormat

THINK, END_THINK = "<think>", "</think>"
_CONTENT, _REASONING, _CALL, _WHOLE = "content", "reasoning", "call", "whole"


@dataclass
class OutputDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, str]] = field(default_factory=list)  # {"name": ..., "arguments": "<json>"}

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


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


def _partial_tag(text: str, tags: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class OutputParser:
    """Feed text deltas; get `OutputDelta`s. `thinking`: the prompt opened `<think>` (the output starts as
    reasoning); `tools`: calls in `fmt` become tool calls (else they are plain content); `schemas` (tool name ->
    `parameters`) types the XML format's values. A format whose calls are the whole answer (`llama3_json`) holds
    an answer that starts like a call until the end, then it is the calls or, when they do not parse, content."""

    def __init__(self, thinking: bool = False, tools: bool = False, fmt: ToolFormat = HERMES,
                 schemas: dict[str, Any] | None = None) -> None:
        self.mode = _REASONING if thinking else _CONTENT
        self.reasoning_seen = thinking
        self.tools = tools
        self.fmt, self.schemas = fmt, schemas
        self.buf = ""
        self.content = _Trimmed()
        self.reasoning = _Trimmed()

    def _tags(self) -> list[str]:
        if self.mode == _REASONING:
            return [END_THINK]
        return ([] if self.reasoning_seen else [THINK]) + ([CALL] if self.tools and self.fmt.wrapped else [])

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
                return out
            if self.mode == _CALL:
                end = self.buf.find(END_CALL)
                if end < 0:
                    return out
                body, self.buf = self.buf[:end], self.buf[end + len(END_CALL):]
                self.mode = _CONTENT
                calls = self.fmt.parse(body, self.schemas)
                if calls is not None:
                    out.tool_calls += calls
                else:
                    self._emit(CALL + body + END_CALL, out)
                continue
            if (self.mode == _CONTENT and self.tools and not self.fmt.wrapped and not self.content.started
                    and (THINK not in self.buf or self.reasoning_seen)):
                starts = self._answer_is_call()
                if starts is None:
                    return out
                if starts:
                    self.mode = _WHOLE
                    return out
            tags = self._tags()
            found = [(self.buf.find(t), t) for t in tags if t in self.buf]
            if not found:
                keep = _partial_tag(self.buf, tags)
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

    def finish(self) -> OutputDelta:
        """The end of the text: an unclosed tool call is content; held partial tags are text."""
        out = OutputDelta()
        rest, self.buf = self.buf, ""
        if self.mode == _WHOLE:
            self.mode = _CONTENT
            calls = self.fmt.parse(rest, self.schemas)
            if calls is not None:
                out.tool_calls += calls
                return out
        if self.mode == _CALL:
            self.mode = _CONTENT
            rest = CALL + rest
        self._emit(rest, out)
        return out


def parse_assistant_output(text: str, thinking: bool | None = None, tools: bool = True, fmt: ToolFormat = HERMES,
                           schemas: dict[str, Any] | None = None) -> tuple[str, str | None, list[dict[str, Any]]]:
    """The whole text at once: `(content, reasoning or None, tool calls)`, each call in OpenAI's form
    `{"id": "call_<i>", "type": "function", "function": {"name", "arguments": "<json>"}}`. `thinking` None: the
    text starts inside reasoning when it closes a `</think>` it did not open."""
    if thinking is None:
        end = text.find(END_THINK)
        thinking = end >= 0 and THINK not in text[:end]
    parser = OutputParser(thinking, tools, fmt, schemas)
    a, b = parser.feed(text), parser.finish()
    calls = [{"id": f"call_{i}", "type": "function", "function": c} for i, c in enumerate(a.tool_calls + b.tool_calls)]
    return a.content + b.content, (a.reasoning + b.reasoning) or None, calls
