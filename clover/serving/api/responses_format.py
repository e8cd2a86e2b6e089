"""The Responses API's objects: output items built from a chat choice's deltas, the response body, and the
server-sent events of a streamed response (their shapes: the `openai` package's `openai.types.responses`).

A chat choice's answer arrives as `OutputDelta`s (reasoning, content, tool calls as they are written:
`openai_format.ChatChoice`). `OutputItems` turns them into output items in the order they come: a `reasoning` item
while reasoning flows, a `message` item (one `output_text` part) while content flows, and a `function_call` item
per call, its arguments streamed; a change of kind closes the open text item. Each change is also returned as the stream events that announce it, so a streamed and a
whole response are built by the same code from the same deltas:

    response.created, response.in_progress
    per text item:  response.output_item.added, response.content_part.added,
                    response.output_text.delta (response.reasoning_text.delta) ...,
                    response.output_text.done (response.reasoning_text.done), response.content_part.done,
                    response.output_item.done
    per call:       response.output_item.added (at the call's name), response.function_call_arguments.delta
                    (each fragment as it is written), response.function_call_arguments.done,
                    response.output_item.done
    response.completed, or response.incomplete (the length limit), or on a failure error + response.failed

Every event carries a `sequence_number` from 0 (`EventStream`); the stream has no `[DONE]`, as OpenAI's has none.
"""

from __future__ import annotations

import copy
import itertools
import json
import uuid
from typing import Any

from clover.assistant_output import OutputDelta
from clover.tool_formats import CallDelta


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """A response's output items, as a chat choice's deltas arrive (module docstring)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the reasoning or message item text flows into
        self.call_items: dict[int, dict[str, Any]] = {}  # call index -> its item
        self.output_index: dict[str, int] = {}  # item id -> its place in `items`

    def push(self, delta: OutputDelta, call_ids: list[str], cut: set[int] | frozenset[int] = frozenset()) -> list[dict[str, Any]]:
        """The events announcing what `delta` adds (in the chat template's order: reasoning, text, calls);
        `call_ids[i]`: call i's id; `cut`: the calls the length limit cut (their items end `incomplete`)."""
        events = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.tool_calls:
            events += self._call(call, call_ids, cut)
        return events

    def finish(self, status: str = "completed") -> list[dict[str, Any]]:
        """Close the open item (`incomplete` when the answer was cut by the length limit)."""
        return self._close(status)

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        """An event's item reference (a call's fragments may follow text that one block wrote after it)."""
        return {"item_id": item["id"], "output_index": self.output_index[item["id"]]}

    def _append(self, item: dict[str, Any]) -> None:
        self.output_index[item["id"]] = len(self.items)
        self.items.append(item)

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events = self._close() + self._open(kind)
        item = self.open
        assert item is not None
        item["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return events + [{"type": name, **self._where(item), "content_index": 0, "delta": text, **extra}]

    def _open(self, kind: str) -> list[dict[str, Any]]:
        if kind == "message":
            item = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "status": "in_progress", "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self._append(item)
        self.open = item
        events = [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                   "item": copy.deepcopy(item)},
                  {"type": "response.content_part.added", **self._where(item), "content_index": 0, "part": dict(part)}]
        item["content"].append(part)
        return events

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        part = item["content"][0]
        if item["type"] == "message":
            done = {"type": "response.output_text.done", **self._where(item), "content_index": 0,
                    "text": part["text"], "logprobs": []}
        else:
            done = {"type": "response.reasoning_text.done", **self._where(item), "content_index": 0,
                    "text": part["text"]}
        return [done,
                {"type": "response.content_part.done", **self._where(item), "content_index": 0, "part": dict(part)},
                {"type": "response.output_item.done", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)}]

    def _call(self, delta: CallDelta, call_ids: list[str], cut: set[int] | frozenset[int]) -> list[dict[str, Any]]:
        """A piece of a call: its start opens its item (closing the open text item), a fragment of its arguments
        adds to it, its end closes it."""
        events = []
        if delta.name is not None:
            events = self._close()
            item = {"id": _id("fc"), "type": "function_call", "call_id": call_ids[delta.index], "name": delta.name,
                    "arguments": "", "status": "in_progress"}
            self._append(item)
            self.call_items[delta.index] = item
            events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                           "item": dict(item)})
        item = self.call_items[delta.index]
        if delta.arguments:
            item["arguments"] += delta.arguments
            events.append({"type": "response.function_call_arguments.delta", **self._where(item),
                           "delta": delta.arguments})
        if delta.done:
            item["status"] = "incomplete" if delta.index in cut else "completed"
            events += [{"type": "response.function_call_arguments.done", **self._where(item),
                        "arguments": item["arguments"]},
                       {"type": "response.output_item.done", "output_index": self._where(item)["output_index"],
                        "item": dict(item)}]
        return events


def usage(input_tokens: int, output_tokens: int, cached: int, reasoning: int) -> dict[str, Any]:
    """`cache_write_tokens` is not tracked per request (the prefix cache stores prompts on its own grid): 0."""
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": reasoning}}


class EventStream:
    """Server-sent events of one streamed response: each event named by its type and numbered in order."""

    def __init__(self) -> None:
        self.numbers = itertools.count()

    def event(self, body: dict[str, Any]) -> str:
        body = {**body, "sequence_number": next(self.numbers)}
        return f"event: {body['type']}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"
