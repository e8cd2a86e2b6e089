"""OpenAI structured outputs (`response_format`) on chat completions, served by decision decoding.

`response_format: {"type": "json_schema", "json_schema": {"name", "schema"}}` with a schema inside the decision
subset (`clover.engine.constraints.form`: a flat object of enum / boolean / bounded integer / bounded string fields) is
answered by `clover.engine.loops.decision.decide` on the chat messages: the message content is the JSON object,
valid against the schema (routing: `clover.serving.grammar_route.route`; other schemas take the grammar path),
and the response carries a `decision` object (each field's probability, forward
passes, the order the fields were decided in). A schema outside the subset, `json_object`, or options that do
not apply (`n > 1`, tools) are a 400 naming the parameter — for a schema, the field and the keyword.

The prompt is rendered on a worker thread (holding the tokenizer's lock); the decision then runs in the scheduler
(`Scheduler.decide`): it waits in the one queue with generation requests (first come, first served), its rows
count against `max_running`, and it takes one forward per scheduler iteration beside the generation batches'
steps, on the thread that owns the runner — so it works on every runner, the llama.cpp runner included. Greedy:
sampling fields are ignored; `threshold` (extra body field) applies.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from clover.engine.loops.decision import DecisionRun
from clover.engine.constraints.form import Form, FormError, parse_form
from clover.serving.scheduling.handles import until_disconnect
from clover.serving.api.openai_format import sse, usage as usage_of
from clover.serving.api.protocol import SCHEMA_PARAM, APIError, ChatCompletionRequest
from clover.serving.request_context import REQUEST_ID, internal_error, unavailable
from clover.serving.scheduling.scheduler import QueueFull

logger = logging.getLogger(__name__)


def check_form(req: ChatCompletionRequest) -> Form:
    """The request's form, or the 400 that names what cannot be served."""
    response_format = req.response_format
    assert response_format is not None
    if response_format.type == "json_object":
        raise APIError(400, "response_format type 'json_object' is not supported: give type 'json_schema' with a "
                            "schema (flat object of enum, boolean, bounded integer or bounded string fields)",
                       param="response_format.type", code="invalid_value")
    try:
        form = parse_form(response_format.json_schema.schema_)
    except FormError as exc:
        param = f"{SCHEMA_PARAM}.{exc.path}" if exc.path else SCHEMA_PARAM
        raise APIError(400, f"{SCHEMA_PARAM}: {exc}", param=param, code="unsupported_schema") from exc
    if req.n != 1:
        raise APIError(400, "n must be 1 with response_format (decisions are greedy)", param="n", code="invalid_value")
    if req.tools and req.tool_choice != "none":
        raise APIError(400, "tools and response_format cannot be combined", param="response_format",
                       code="invalid_value")
    return form


async def decision_response(server: Any, req: ChatCompletionRequest, request: Request) -> Response:
    """The chat completion for a request with `response_format` (`server`: the app's `ServedModel`). A client
    that leaves before the decision is made stops it (its rows are freed), as a generation's does."""
    form = check_form(req)
    messages = [m.to_template() for m in req.messages]
    threshold = req.threshold if req.threshold is not None else server.scheduler.default_threshold

    def prepare() -> DecisionRun:
        with server.tokenizer.lock:
            return DecisionRun.create(server.runner, server.tokenizer.tokenizer, [messages], form,
                                      threshold=threshold, prefill_chunk=server.options.prefill_chunk,
                                      decode=server.tokenizer.decode)

    try:
        run = await run_in_threadpool(prepare)
        decision = server.scheduler.decide(run)
    except QueueFull as exc:
        raise APIError(429, f"{exc}; retry later", type="rate_limit_error", code="server_busy") from exc
    except ValueError as exc:  # DecisionRun's own words, e.g. the prompt and the answer block beyond the context
        raise APIError(400, str(exc), param="messages", code="invalid_value") from exc
    except RuntimeError as exc:  # the scheduler stopped
        raise unavailable() from exc
    done = await until_disconnect(request, decision)
    if done.exception() is not None:  # a step raised: our bug, named by the request id only
        logger.error("request %s: decision failed", REQUEST_ID.get(), exc_info=done.exception())
        raise internal_error()
    result = done.result()[0]
    content = json.dumps(result.values, ensure_ascii=False)
    rid, created, name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), server.options.served_model_name
    usage = usage_of(result.prompt_tokens, result.answer_tokens, 0)
    extra = {"decision": {"probabilities": result.probabilities, "forward_passes": result.forward_passes,
                          "order": result.order}}
    if not req.stream:
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": name,
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                          "finish_reason": "stop", "logprobs": None}],
                             "usage": usage, **extra})

    def chunk(delta: dict[str, Any], finish: str | None = None, **more: Any) -> str:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **more}
        return sse(body)

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    pieces = [chunk({"role": "assistant", "content": ""}), chunk({"content": content}),
              chunk({}, "stop", **extra)]
    if include_usage:
        final = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name, "choices": [],
                 "usage": usage}
        pieces.append(sse(final))

    async def events() -> Any:
        for piece in pieces:
            yield piece
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
