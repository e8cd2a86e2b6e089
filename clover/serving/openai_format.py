"""OpenAI's response formats: chat and text completion bodies, their streamed (SSE) chunks, usage.

Committed blocks arrive per choice (`Output`); `ChoiceText` detokenises them incrementally (stop strings held back
until they cannot match), `ChatChoice` also splits reasoning, content and tool calls (`OutputParser`), the same
way for streamed and whole responses. The request flow that feeds them is `served_model.py`'s.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, AsyncIterator, Callable

from clover.engine import StopAwareDetokenizer
from clover.serving.handles import Output, RequestHandle, merge
from clover.assistant_output import OutputDelta, OutputParser
from clover.serving.protocol import APIError

logger = logging.getLogger(__name__)


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

    def push(self, out: Output) -> str:
        self.tokens += len(out.token_ids)
        if out.finished:
            self.finished = True
            self.finish_reason = "length" if out.finish_reason == "length" else "stop"
            if out.finish_reason == "repetition":
                self.extra = {"stop_reason": "repetition"}
        return self.detok.push(out.token_ids, out.finished, (out.stats or {}).get("stop_string"))


class ChatChoice(ChoiceText):
    """A chat choice: its text split into reasoning, content and tool calls (ids given here) as it arrives.
    `forced`: the start of the answer the server wrote itself (a forced tool call), parsed but never sent.
    `max_calls`: the calls kept (`parallel_tool_calls: false`: the first), None: all."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...], thinking: bool, tools: bool,
                 forced: str, max_calls: int | None = None) -> None:
        super().__init__(decode, stops)
        self.parser = OutputParser(thinking, tools)
        self.max_calls = max_calls
        self.content, self.reasoning, self.calls = "", "", []
        self._take(self.parser.feed(forced))

    def _take(self, delta: OutputDelta) -> OutputDelta:
        calls = delta.tool_calls if self.max_calls is None else delta.tool_calls[:self.max_calls - len(self.calls)]
        delta.tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": c}
                            for c in calls]
        self.content += delta.content
        self.reasoning += delta.reasoning
        self.calls += delta.tool_calls
        return delta

    def push_output(self, out: Output) -> OutputDelta:
        """What one committed block adds; at the end, a finished answer with tool calls has reason `tool_calls`."""
        delta = self.parser.feed(self.push(out))
        if out.finished:
            rest = self.parser.finish()
            delta = OutputDelta(delta.content + rest.content, delta.reasoning + rest.reasoning,
                                delta.tool_calls + rest.tool_calls)
        delta = self._take(delta)
        if self.finished and self.calls and self.finish_reason == "stop":
            self.finish_reason = "tool_calls"
        return delta

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content if self.content or not self.calls
                               else None}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chat_body(rid: str, created: int, model: str, choices: list[ChatChoice],
              usage: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion."""
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": i, "message": c.message(), "finish_reason": c.finish_reason, **c.extra,
                     "logprobs": None} for i, c in enumerate(choices)],
        "usage": usage,
    }


def completion_body(rid: str, created: int, model: str, choices: list[ChoiceText], texts: list[str],
                    usage: dict[str, Any]) -> dict[str, Any]:
    """A whole text completion (`texts[k]`: choice k's text, echoed prompt included)."""
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": k, "text": texts[k], "finish_reason": c.finish_reason, **c.extra, "logprobs": None}
                    for k, c in enumerate(choices)],
        "usage": usage,
    }


def chunk_sse(rid: str, obj: str, created: int, model: str, include_usage: bool, choice: dict[str, Any]) -> str:
    """One SSE chunk of a streamed response (chat or completion: they differ in `object` and the choice)."""
    body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model,
                            "choices": [{**choice, "logprobs": None}]}
    if include_usage:
        body["usage"] = None  # OpenAI: usage is null on every chunk but the final one
    return sse(body)


async def chat_stream(handle: RequestHandle, choices: list[ChatChoice], rid: str, created: int, model: str,
                      prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
    """A chat completion's SSE events: a role chunk per choice, the deltas of committed blocks, a finish chunk per
    choice, the usage chunk when asked for, `[DONE]`; an error after the start is reported in-band."""

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, extra: dict[str, Any] = {}) -> str:
        return chunk_sse(rid, "chat.completion.chunk", created, model, include_usage,
                         {"index": index, "delta": delta, "finish_reason": finish, **extra})

    try:
        for i in range(len(choices)):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for out in handle:
            c = choices[out.choice]
            known = len(c.calls)
            delta = c.push_output(out)
            body: dict[str, Any] = {}
            if delta.reasoning:
                body["reasoning_content"] = delta.reasoning
            if delta.content:
                body["content"] = delta.content
            if delta.tool_calls:
                body["tool_calls"] = [{"index": known + k, **call} for k, call in enumerate(delta.tool_calls)]
            if body:
                yield chunk(out.choice, body)
            if out.finished:
                yield chunk(out.choice, {}, c.finish_reason, c.extra)
        if include_usage:
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": usage(prompt_tokens, sum(c.tokens for c in choices),
                                                     max(handle.cached_tokens))})
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
        logger.exception("generation failed")
        yield sse(APIError(500, f"generation failed: {exc}", type="server_error", code="internal_error").body())
    finally:
        handle.cancel()  # no-op when finished; frees the slots when the client went away
    yield "data: [DONE]\n\n"


async def completion_stream(handles: list[RequestHandle], choices: list[ChoiceText], echo: list[str], n: int,
                            rid: str, created: int, model: str, prompt_tokens: int,
                            include_usage: bool) -> AsyncIterator[str]:
    """A text completion's SSE events (choice `k` is choice `k % n` of prompt `k // n`), as `chat_stream`."""

    def chunk(index: int, text: str, finish: str | None = None, extra: dict[str, Any] = {}) -> str:
        return chunk_sse(rid, "text_completion", created, model, include_usage,
                         {"index": index, "text": text, "finish_reason": finish, **extra})

    try:
        for k, text in enumerate(echo):
            if text:
                yield chunk(k, text)
        async for i, out in merge(handles):
            k = i * n + out.choice
            text = choices[k].push(out)
            if text:
                yield chunk(k, text)
            if out.finished:
                yield chunk(k, "", choices[k].finish_reason, choices[k].extra)
        if include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": usage(prompt_tokens, sum(c.tokens for c in choices),
                                                     sum(max(h.cached_tokens) for h in handles))})
    except Exception as exc:  # noqa: BLE001
        logger.exception("generation failed")
        yield sse(APIError(500, f"generation failed: {exc}", type="server_error", code="internal_error").body())
    finally:
        for h in handles:
            h.cancel()
    yield "data: [DONE]\n\n"
