"""The HTTP server: OpenAI's `/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/models`, plus
`/health`, `/metrics`.

    app = create_app("checkpoints/clover-smol", options=ServerOptions(api_key="..."))
    uvicorn.run(app, host="127.0.0.1", port=8000)

This module is the routes only. Each role has its module: `served_model.py` (options, the model, its tokenizer and
scheduler, what the routes share), `chat.py` / `completions.py` / `responses.py` (each route's request flow),
`openai_format.py` (response bodies, SSE chunks), `middleware.py` (request ids, auth, body limit, errors), `scheduler.py` /
`scheduler_policy.py` / `handles.py` (continuous batching).

Every error is OpenAI's `{"error": {"message", "type", "param", "code"}}`, always with a code, and a 4xx status for
what the client got wrong: malformed JSON / wrong types / text that is not Unicode (400), bad API key (401),
unknown model or route (404), body too large (413), prompt or `max_tokens` beyond the context (400,
`context_length_exceeded`), full queue (429). Anything else is a bug, answered as a 500 naming the request id;
no error drops the client's keep-alive connection (see `middleware.RequestGuard`).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from clover.engine.runner import ModelRunner
from clover.serving.chat import create_chat_completion
from clover.serving.completions import create_completion
from clover.serving.middleware import add_error_handling
from clover.serving.api.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from clover.serving.request_context import CLIENT_KEY
from clover.serving.responses import create_response, delete_response, stored_response
from clover.serving.api.responses_protocol import ResponsesRequest
from clover.serving.served_model import ServedModel, ServerOptions, load

ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 503)}
# `stream: true` answers server-sent events, documented beside the JSON body so that a client generated from the
# schema (and a fuzzer checking content types) accepts them: each event's `data` is a JSON chunk (or `[DONE]`),
# named by `event` on /v1/responses
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}
STREAMED = {**ERRORS, 200: {"description": "The answer: JSON, or with `stream: true` server-sent events",
                            "content": {"text/event-stream": {"schema": SSE_EVENT}}}}

__all__ = ["ServerOptions", "create_app"]


def create_app(model: torch.nn.Module | ModelRunner | str | Path, tokenizer: Any = None,
               options: ServerOptions | None = None, generation_defaults: dict[str, Any] | None = None) -> FastAPI:
    """The FastAPI app serving `model` (a loaded model or runner with its `tokenizer`, or a checkpoint directory).

    `generation_defaults`: sampling defaults of a loaded model (a checkpoint directory's are read from its
    generation_config.json). The scheduler thread starts with the app (lifespan) and stops with it."""
    options = options or ServerOptions()
    defaults = generation_defaults or {}
    if isinstance(model, (str, Path)):
        model, loaded_tokenizer, defaults = load(model)
        tokenizer = tokenizer or loaded_tokenizer
    else:
        if tokenizer is None:
            raise ValueError("create_app(model=<loaded model>) needs its tokenizer")
    server = ServedModel(model.eval() if isinstance(model, torch.nn.Module) else model, tokenizer, options, defaults)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(server.scheduler.start)  # the default engine is made (calibrated) on its thread
        try:
            yield
        finally:
            await run_in_threadpool(server.scheduler.stop)

    app = FastAPI(title="Clover", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server for Clover block-diffusion models")
    app.state.server = server

    @app.post("/v1/chat/completions", responses=STREAMED)
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(server, req, request)

    @app.post("/v1/completions", responses=STREAMED)
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await create_completion(server, req, request)

    @app.post("/v1/responses", responses=STREAMED)
    async def create(req: ResponsesRequest, request: Request) -> Response:
        return await create_response(server, req, request)

    @app.get("/v1/responses/{response_id}", responses=ERRORS)
    async def retrieve(response_id: str) -> dict[str, Any]:
        return stored_response(server, response_id)

    @app.delete("/v1/responses/{response_id}", responses=ERRORS)
    async def delete(response_id: str) -> dict[str, Any]:
        return delete_response(server, response_id)

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": server.created, "owned_by": "clover",
                "max_model_len": server.context}

    @app.get("/v1/models", responses=ERRORS)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name) for name in server.model_names]}

    @app.get("/v1/models/{model_id}", responses=ERRORS)
    async def model_info(model_id: str) -> dict[str, Any]:
        server.check_model(model_id)
        return model_card(model_id)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Needs no key; the load (sequences per stage, every key's) only to a client with one, where keys are set."""
        if not server.scheduler.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        if server.options.api_keys and CLIENT_KEY.get() is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "ok", **server.scheduler.load})

    @app.get("/metrics", response_class=PlainTextResponse)  # Prometheus' text format, so documented
    async def metrics() -> Response:
        """The server's figures and the calling key's own (`ServerMetrics`)."""
        return Response(server.metrics.render(CLIENT_KEY.get()), media_type=server.metrics.content_type)

    add_error_handling(app, server)
    return app
