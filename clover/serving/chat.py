"""Chat completions (`POST /v1/chat/completions`), vLLM's `serving_chat`: route the request (free text, a grammar,
or decision mode: `grammar_route.route`), render the chat template and tokenize in a worker thread, check
`max_tokens` against the context, submit one sequence per choice, then stream the committed blocks as SSE
(`chat_stream`) or collect them into one body (the formats: `openai_format.py`). The Responses API runs through `start_chat` (responses.py).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2.exceptions import TemplateError
from starlette.concurrency import run_in_threadpool

from clover.chat_template import opens_reasoning
from clover.engine.constraints.grammar import Grammar
from clover.engine.request import RequestOptions
from clover.serving.grammar_route import forced_start, grammar_param, max_calls, request_grammar, route
from clover.serving.scheduling.handles import RequestHandle
from clover.serving.api.openai_format import (ChatChoice, TokenBytes, TokenTexts, chat_body, chat_logprobs, chunk_sse,
                                              sse, usage)
from clover.serving.api.protocol import APIError, ChatCompletionRequest
from clover.serving.request_context import GRAMMAR_PARAM, REQUEST_ID, request_failure
from clover.serving.structured import decision_response

if TYPE_CHECKING:
    from clover.serving.served_model import ServedModel

logger = logging.getLogger(__name__)


@dataclass
class ChatRun:
    """A submitted chat request: its handle, one `ChatChoice` per choice (fed with the handle's outputs by whoever
    reads it), its prompt's length in tokens, and the options it runs with (its first choice's)."""

    handle: RequestHandle
    choices: list[ChatChoice]
    prompt_tokens: int
    options: RequestOptions


async def create_chat_completion(server: ServedModel, req: ChatCompletionRequest, request: Request) -> Response:
    server.check_model(req.model)
    path = route(req)
    if path == "decision":  # structured outputs in the form subset: decision decoding (structured.py)
        if req.logprobs:
            raise APIError(400, "logprobs cannot be combined with a response_format served by decision mode "
                                "(its slots are scored as whole values); pass structured_mode 'grammar'",
                           param="logprobs", code="unsupported_parameter")
        return await decision_response(server, req, request)
    run = await start_chat(server, req, path)
    handle, choices = run.handle, run.choices
    rid, created, name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), server.options.served_model_name
    texts, raw = server.tokenizer.token_texts, server.tokenizer.token_bytes
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(chat_stream(handle, choices, rid, created, name, run.prompt_tokens, include_usage,
                                             texts, raw), media_type="text/event-stream")
    await server.collect(request, handle, lambda _, piece: choices[handle.choice(piece)].push_output(piece))
    logprobs = [chat_logprobs(c.logprobs, texts, raw) for c in choices] if req.logprobs else None
    return JSONResponse(chat_body(rid, created, name, choices, usage(run.prompt_tokens, sum(c.tokens for c in choices),
                                                                     max(handle.cached_tokens)), logprobs))


async def start_chat(server: ServedModel, req: ChatCompletionRequest, path: str | None) -> ChatRun:
    """A chat request that `route` sends to free generation (None) or the grammar ("grammar"), submitted: its
    options resolved, its prompt rendered, `max_tokens` checked, the work queued. The caller reads the run (or
    cancels it)."""
    assert path != "decision", "decision mode answers whole (structured.py)"
    rule, grammar, budget = req.rule, None, None
    if path == "grammar":  # grammar-constrained decoding, in exact mode (grammar_route.py)
        GRAMMAR_PARAM.set(grammar_param(req))  # in this request's context: what its failure names
        grammar = await run_in_threadpool(_grammar, server, req)
        rule = rule or "exact"
    else:  # a grammar's answer is rendered without reasoning: no budget to keep (clover.engine.constraints.thinking)
        budget = server.thinking_budget(req)
    options = server.request_options(req, grammar=grammar, thinking_budget=budget)
    ids, forced, thinking, tools = await run_in_threadpool(chat_prompt, server, req, path == "grammar")
    param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
    max_new = await server.max_new_tokens(req.max_new_tokens(), len(ids), req.block_size, rule, param, "messages")
    handle = await server.submit(ids, max_new, req.choice_options(options), req, rule)
    stops = req.stop_strings()
    schemas = {t.function.name: t.function.parameters for t in req.tools or []}
    choices = [ChatChoice(server.tokenizer.decode, stops, thinking, tools, forced, max_calls(req),
                          server.tokenizer.tool_format, schemas) for _ in range(req.n)]
    return ChatRun(handle, choices, len(ids), options)


def _grammar(server: ServedModel, req: ChatCompletionRequest) -> Grammar:
    with server.tokenizer.lock:
        return request_grammar(req, server.tokenizer.tokenizer, server.tokenizer.tool_format)


def chat_prompt(server: ServedModel, req: ChatCompletionRequest,
                constrained: bool = False) -> tuple[list[int], str, bool, bool]:
    """(prompt ids, forced start of the answer, thinking, parse tool calls). `constrained`: a grammar writes the
    answer (no reasoning first)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    forced = forced_start(req, server.tokenizer.tool_format)
    # a grammar answers at once: no reasoning first, whatever the template's default
    enable = False if forced or constrained else req.enable_thinking
    kwargs = req.chat_template_kwargs.extra() if req.chat_template_kwargs else {}
    try:
        text = server.tokenizer.render_chat([m.to_template() for m in req.messages], tools, enable, kwargs)
    except (ValueError, TemplateError) as exc:  # the checkpoint's template may refuse a conversation itself
        raise APIError(400, f"the chat template cannot render these messages: {exc}" if isinstance(
            exc, TemplateError) else str(exc), param="messages", code="invalid_value") from exc
    ids = server.tokenizer.encode(text + forced)
    return ids, forced, opens_reasoning(text), bool(tools) and req.tool_choice != "none"


async def chat_stream(handle: RequestHandle, choices: list[ChatChoice], rid: str, created: int, model: str,
                      prompt_tokens: int, include_usage: bool, texts: TokenTexts | None = None,
                      raw: TokenBytes | None = None) -> AsyncIterator[str]:
    """A chat completion's SSE events: a role chunk per choice, the deltas of committed blocks (with their tokens'
    logprobs when asked for: `texts` names the tokens), a finish chunk per choice, the usage chunk when asked for,
    `[DONE]`; an error after the start is reported in-band."""

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, extra: dict[str, Any] = {}) -> str:
        return chunk_sse(rid, "chat.completion.chunk", created, model, include_usage,
                         {"index": index, "delta": delta, "finish_reason": finish, **extra})

    try:
        for i in range(len(choices)):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for out in handle:
            index = handle.choice(out)
            c = choices[index]
            delta = c.push_output(out)
            text: dict[str, Any] = {}
            if delta.reasoning:
                text["reasoning_content"] = delta.reasoning
            if delta.content:
                text["content"] = delta.content
            bodies = ([text] if text else []) + [{"tool_calls": [e]} for e in c.call_entries(delta.tool_calls)]
            if out.logprobs and texts is not None:  # a token's values come with the block that committed it
                yield chunk(index, bodies.pop(0) if bodies else {},
                            extra={"logprobs": chat_logprobs(out.logprobs, texts, raw)})
            for body in bodies:
                yield chunk(index, body)
            if out.finished:
                yield chunk(index, {}, c.finish_reason, c.extra)
        if include_usage:
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": usage(prompt_tokens, sum(c.tokens for c in choices),
                                                     max(handle.cached_tokens))})
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
        logger.exception("request %s: generation failed", REQUEST_ID.get())
        yield sse(request_failure(exc).body())
    finally:
        handle.cancel()  # no-op when finished; frees the slots when the client went away
    yield "data: [DONE]\n\n"
