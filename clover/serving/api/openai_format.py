"""OpenAI's response formats: chat and text completion bodies, their streamed (SSE) chunks, usage.

Committed blocks arrive per choice (the engine's `StreamPiece`); `ChoiceText` detokenises them incrementally (stop strings held back
until they cannot match), `ChatChoice` also splits reasoning, content and tool calls (`OutputParser`), the same
way for streamed and whole responses. A streamed tool call goes out as it is written, in OpenAI's chunks: one
with its `index`, `id`, `type` and `function.name` (`arguments: ""`), then its `function.arguments` fragments;
a block that finishes one call and starts others sends each call's chunks whole and in order. The request flows
that feed them, and stream them, are `chat.py`'s and `completions.py`'s.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any, Callable, Sequence

from clover.engine import StopAwareDetokenizer
from clover.assistant_output import OutputDelta, OutputParser
from clover.tool_formats import HERMES, CallDelta, ToolFormat

if TYPE_CHECKING:
    from clover.engine.logprobs import TokenLogprob
    from clover.engine.loops.loop import StreamPiece


TokenTexts = Callable[[list[int]], list[str]]  # ids -> each token's own text
TokenBytes = Callable[[list[int]], list[bytes]]  # ids -> each token's own bytes
LOWEST_LOGPROB = -9999.0  # JSON has no -inf: a token the model rules out is reported this low (as vLLM does)


# -- per-choice text assembly ----------------------------------------------------------------------------------
class ChoiceText:
    """One choice's text as its blocks arrive (stop strings held back and cut, see `StopAwareDetokenizer`), with
    its token count and finish reason. An answer the loop guard ended reports OpenAI's "stop" (clients reject
    reasons they do not know) with vLLM's `stop_reason` field saying "repetition" (`extra`)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...]) -> None:
        self.detok = StopAwareDetokenizer(decode, stops)
        self.tokens = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.extra: dict[str, Any] = {}  # fields beside finish_reason in the choice
        self.token_ids: list[int] = []  # kept with `logprobs`, when the request asked for them
        self.logprobs: list[TokenLogprob] = []

    def push(self, out: StreamPiece) -> str:
        self.tokens += len(out.token_ids)
        if out.logprobs is not None:
            self.token_ids += out.token_ids
            self.logprobs += out.logprobs
        if out.finished:
            self.finished = True
            self.finish_reason = "length" if out.finish_reason == "length" else "stop"
            if out.finish_reason == "repetition":
                self.extra = {"stop_reason": "repetition"}
        return self.detok.push(out.token_ids, out.finished, (out.stats or {}).get("stop_string"))


class ChatChoice(ChoiceText):
    """A chat choice: its text split into reasoning, content and tool calls (ids given here) as it arrives; a call
    streams as it is written (`CallDelta`s), `tool_calls` holds each call as it stands so far (OpenAI's form).
    `forced`: the start of the answer the server wrote itself (a forced tool call), parsed but never sent as text;
    a call it starts goes out with the first block. `max_calls`: the calls kept (`parallel_tool_calls: false`:
    the first), None: all."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...], thinking: bool, tools: bool,
                 forced: str, max_calls: int | None = None, tool_format: ToolFormat = HERMES,
                 schemas: dict[str, Any] | None = None) -> None:
        super().__init__(decode, stops)
        self.parser = OutputParser(thinking, tools, tool_format, schemas)
        self.max_calls = max_calls
        self.content, self.reasoning = "", ""
        self.tool_calls: list[dict[str, Any]] = []
        self.forced = bool(forced)
        self.cut_calls: set[int] = set()  # the calls the length limit cut (reported incomplete)
        self.opening = OutputDelta(tool_calls=self._take(self.parser.feed(forced)).tool_calls)

    def _take(self, delta: OutputDelta) -> OutputDelta:
        delta.tool_calls = [d for d in delta.tool_calls if self.max_calls is None or d.index < self.max_calls]
        for d in delta.tool_calls:
            if d.name is not None:
                assert d.index == len(self.tool_calls), "calls start in index order"
                self.tool_calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                   "function": {"name": d.name, "arguments": ""}})
            self.tool_calls[d.index]["function"]["arguments"] += d.arguments
        self.content += delta.content
        self.reasoning += delta.reasoning
        return delta

    def push_output(self, out: StreamPiece) -> OutputDelta:
        """What one committed block adds; at the end, a finished answer with tool calls has reason `tool_calls`.
        An answer the length limit ended inside a call keeps reason `length`, with the call as far as it got (in
        `cut_calls`); the text of a call block that names no call yet is dropped, never content (a forced call's
        start is the server's text, not the model's)."""
        delta = self.parser.feed(self.push(out))
        first_open = None
        if out.finished:
            cut = self.finish_reason == "length" and (self.parser.tagged or (self.forced and self.parser.in_call))
            first_open = self.parser.next_index if cut else None
            delta = delta + self.parser.finish(cut)
        delta, self.opening = self.opening + self._take(delta), OutputDelta()
        if first_open is not None:
            self.cut_calls.update(range(first_open, len(self.tool_calls)))
        if self.finished and self.tool_calls and self.finish_reason == "stop":
            self.finish_reason = "tool_calls"
        return delta

    def call_entries(self, deltas: list[CallDelta]) -> list[dict[str, Any]]:
        """OpenAI's streamed `delta.tool_calls` entries for `deltas` (this choice's), in order, each to be sent in
        a chunk of its own: a call's start (`index`, `id`, `type`, `function.name`, `arguments: ""`), then its
        argument fragments (those of one block joined)."""
        entries: list[dict[str, Any]] = []
        for d in deltas:
            if d.name is not None:
                entries.append({"index": d.index, "id": self.tool_calls[d.index]["id"], "type": "function",
                                "function": {"name": d.name, "arguments": ""}})
            if not d.arguments:
                continue
            if entries and entries[-1]["index"] == d.index and "id" not in entries[-1]:
                entries[-1]["function"]["arguments"] += d.arguments
            else:
                entries.append({"index": d.index, "function": {"arguments": d.arguments}})
        return entries

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content if self.content or not self.tool_calls
                               else None}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


# -- logprobs ----------------------------------------------------------------------------------------------------
def _token(text: str, logprob: float, raw: bytes | None = None) -> dict[str, Any]:
    return {"token": text, "logprob": max(logprob, LOWEST_LOGPROB),
            "bytes": list(text.encode("utf-8") if raw is None else raw)}


def chat_logprobs(values: Sequence[TokenLogprob], texts: TokenTexts,
                  raw: TokenBytes | None = None) -> dict[str, Any]:
    """A chat choice's `logprobs`: every generated token (reasoning and tool-call text included) with its
    alternatives; `bytes` each token's own (`raw`: a token holding part of a character has text U+FFFD; without
    `raw`, its text's bytes)."""
    names = _names(values, texts)
    ids = list(names)
    own = dict(zip(ids, raw(ids))) if raw is not None else {}
    return {"content": [{**_token(names[v.token], v.logprob, own.get(v.token)),
                         "top_logprobs": [_token(names[t], lp, own.get(t)) for t, lp in v.top]} for v in values],
            "refusal": None}


def completion_logprobs(tokens: Sequence[int], values: Sequence[TokenLogprob | None], texts: TokenTexts,
                        offset: int = 0) -> tuple[dict[str, Any], int]:
    """A text completion's legacy `logprobs` for `tokens` (an echoed prompt's first token has no value: None),
    their text starting at character `offset` of the choice's text; and the offset after them. `top_logprobs`
    holds the asked-for alternatives and the token itself (OpenAI: up to `logprobs + 1` entries), keyed by text:
    of several ids with one text (fragments of a character), the most probable's."""
    names = _names([v for v in values if v is not None], texts, tokens)
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, v in zip(tokens, values):
        out["tokens"].append(names[token])
        out["text_offset"].append(offset)
        offset += len(names[token])
        if v is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(max(v.logprob, LOWEST_LOGPROB))
        top: dict[str, float] = {}
        for t, lp in [*v.top, (token, v.logprob)]:  # ids of one text (byte fragments): the best one's value
            top.setdefault(names[t], max(lp, LOWEST_LOGPROB))
        out["top_logprobs"].append(top)
    return out, offset


def _names(values: Sequence[TokenLogprob], texts: TokenTexts, tokens: Sequence[int] = ()) -> dict[int, str]:
    """Each id's text, for the tokens and their alternatives (one tokenizer call)."""
    ids = list(dict.fromkeys([*tokens, *(v.token for v in values), *(t for v in values for t, _ in v.top)]))
    return dict(zip(ids, texts(ids)))


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chat_body(rid: str, created: int, model: str, choices: list[ChatChoice],
              usage: dict[str, Any], logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A whole chat completion (`logprobs[i]`: choice i's, when asked for)."""
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": i, "message": c.message(), "finish_reason": c.finish_reason, **c.extra,
                     "logprobs": logprobs[i] if logprobs else None} for i, c in enumerate(choices)],
        "usage": usage,
    }


def completion_body(rid: str, created: int, model: str, choices: list[ChoiceText], texts: list[str],
                    usage: dict[str, Any], logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A whole text completion (`texts[k]`: choice k's text, echoed prompt included; `logprobs[k]` its logprobs,
    when asked for)."""
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": k, "text": texts[k], "finish_reason": c.finish_reason, **c.extra,
                     "logprobs": logprobs[k] if logprobs else None} for k, c in enumerate(choices)],
        "usage": usage,
    }


def chunk_sse(rid: str, obj: str, created: int, model: str, include_usage: bool, choice: dict[str, Any]) -> str:
    """One SSE chunk of a streamed response (chat or completion: they differ in `object` and the choice)."""
    body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model,
                            "choices": [{"logprobs": None, **choice}]}
    if include_usage:
        body["usage"] = None  # OpenAI: usage is null on every chunk but the final one
    return sse(body)
