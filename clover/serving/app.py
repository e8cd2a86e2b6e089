"""The HTTP server: OpenAI's `/v1/chat/completions`, `/v1/completions`, `/v1/models`, plus `/health`, `/metrics`.

    app = create_app("checkpoints/clover-smol", options=ServerOptions(api_key="..."))
    uvicorn.run(app, host="127.0.0.1", port=8000)

The route handlers are thin: validate (pydantic, `protocol.py`), render the chat template, tokenize, submit to
the `Scheduler` (one background thread owns the model), then turn committed blocks into OpenAI JSON or SSE
chunks. Text is detokenised incrementally per choice; stop strings are held back until they cannot match;
`OutputParser` splits reasoning, content and tool calls the same way for streamed and whole responses.

Every error is OpenAI's `{"error": {"message", "type", "param", "code"}}`, always with a code, and a 4xx status for
what the client got wrong: malformed JSON / wrong types / text that is not Unicode (400), bad API key (401),
unknown model or route (404), body too large (413), prompt or `max_tokens` beyond the context (400,
`context_length_exceeded`), full queue (429). Anything else is a bug, answered as a 500 naming the request id;
no error drops the client's keep-alive connection (see `_Guard`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from clover.engine import RULES, SamplingParams, StopAwareDetokenizer
from clover.serving.metrics import ServerMetrics
from clover.serving.output_parser import CALL, OutputDelta, OutputParser
from clover.serving.prefix_cache import PrefixCache
from clover.serving.protocol import (APIError, ChatCompletionRequest, CompletionRequest, ErrorResponse,
                                     NamedToolChoice, SamplingFields)
from clover.serving.scheduler import Output, QueueFull, RequestHandle, Scheduler
from clover.serving.structured import decision_response, wants_decision
from clover.tokenizer import eos_token_ids
from clover.chat_template import render_chat

logger = logging.getLogger(__name__)

ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 503)}
ROUTES = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"}


@dataclass
class ServerOptions:
    served_model_name: str = "clover"  # the model id of responses and /v1/models
    model_aliases: tuple[str, ...] = ()  # other ids requests may name (the default model: its versioned id)
    api_key: str | None = None  # every route but /health then needs `Authorization: Bearer <key>`
    max_running: int = 32  # sequences decoded together
    max_waiting: int = 256  # more sequences queued before 429
    max_body_bytes: int = 4 * 2**20
    max_model_len: int | None = None  # context served (default and cap: the model's max_position_embeddings)
    block_size: int | None = None  # defaults: the model's config
    threshold: float | None = None
    rule: str = "threshold"
    prefill_chunk: int = 256  # prompt tokens per prefill forward = the prefix cache's grid
    prefix_cache_bytes: int = 2 * 2**30  # 0: no prefix reuse
    prefix_snapshot_interval: int | None = None  # hybrid models: recurrent snapshots every this many tokens
    temperature: float | None = None  # default when a request gives none: generation_config.json, else 0
    top_p: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_running", "max_body_bytes", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerOptions.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting < 0 or self.prefix_cache_bytes < 0:
            raise ValueError("ServerOptions.max_waiting and prefix_cache_bytes must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"ServerOptions.max_model_len must be >= 1, got {self.max_model_len}")


class _Tokenizer:
    """The tokenizer behind one lock: a fast tokenizer may refuse concurrent use from several threads (its
    Rust object is borrowed mutably when encoding), and the scheduler thread decodes for stop strings."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        with self.lock:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        with self.lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    thinking: bool) -> str:
        with self.lock:
            return render_chat(self.tokenizer, messages, tools, add_generation_prompt=True,
                               enable_thinking=thinking)

    def __len__(self) -> int:
        return len(self.tokenizer)


# -- per-choice text assembly ----------------------------------------------------------------------------------
class _ChoiceText:
    """One choice's text as its blocks arrive (stop strings held back and cut, see `StopAwareDetokenizer`), with
    its token count and finish reason."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...]) -> None:
        self.detok = StopAwareDetokenizer(decode, stops)
        self.tokens = 0
        self.finished = False
        self.finish_reason: str | None = None

    def push(self, out: Output) -> str:
        self.tokens += len(out.token_ids)
        if out.finished:
            self.finished = True
            self.finish_reason = "length" if out.finish_reason == "length" else "stop"
        return self.detok.push(out.token_ids, out.finished, (out.stats or {}).get("stop_string"))


class _ChatChoice(_ChoiceText):
    """A chat choice: its text split into reasoning, content and tool calls (ids given here) as it arrives.
    `forced`: the start of the answer the server wrote itself (a forced tool call), parsed but never sent."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...], thinking: bool, tools: bool,
                 forced: str) -> None:
        super().__init__(decode, stops)
        self.parser = OutputParser(thinking, tools)
        self.content, self.reasoning, self.calls = "", "", []
        self._take(self.parser.feed(forced))

    def _take(self, delta: OutputDelta) -> OutputDelta:
        delta.tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": c}
                            for c in delta.tool_calls]
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


async def _merge(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, Output]]:
    """Outputs of several requests as they come (one completion request with several prompts)."""
    if len(handles) == 1:
        async for out in handles[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Output | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle) -> None:
        try:
            async for out in handle:
                await queue.put((i, out))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, exc))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        open_ = len(handles)
        while open_:
            i, item = await queue.get()
            if item is None:
                open_ -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


# -- the server ----------------------------------------------------------------------------------------------------
class _Server:
    """One served model: its tokenizer and scheduler, and what turns a request into engine work and back."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, options: ServerOptions,
                 generation_defaults: dict[str, Any]) -> None:
        config = model.config
        self.model, self.options, self.config = model, options, config
        self.tokenizer = _Tokenizer(tokenizer)
        limit = config.max_position_embeddings
        self.context = min(options.max_model_len or limit, limit)
        self.block_size = options.block_size or config.block_size
        self.threshold = options.threshold if options.threshold is not None else config.threshold
        self.temperature = options.temperature if options.temperature is not None else \
            float(generation_defaults.get("temperature") or 0.0)
        self.top_p = options.top_p if options.top_p is not None else float(generation_defaults.get("top_p") or 1.0)
        eos = eos_token_ids(config, tokenizer)
        self.metrics = ServerMetrics()
        prefix_cache = None
        if options.prefix_cache_bytes > 0:
            prefix_cache = PrefixCache(options.prefill_chunk, options.prefix_cache_bytes,
                                       recurrent=config.has_linear_attention,
                                       snapshot_interval=options.prefix_snapshot_interval)
        self.scheduler = Scheduler(
            model, block_size=self.block_size, threshold=self.threshold, rule=options.rule,
            eos_token_ids=eos, vocab_limit=len(self.tokenizer), detokenize=self.tokenizer.decode,
            prefill_chunk=options.prefill_chunk, prefix_cache=prefix_cache, max_running=options.max_running,
            max_waiting=options.max_waiting, metrics=self.metrics)
        self.scheduler.engine()  # validate the defaults (block size, threshold, rule) now, not at a request
        self.created = int(time.time())

    # -- request -> engine ---------------------------------------------------------------------------------
    @property
    def model_names(self) -> list[str]:
        return [self.options.served_model_name, *self.options.model_aliases]

    def check_model(self, name: str) -> None:
        if name not in self.model_names:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{' or '.join(map(repr, self.model_names))}", param="model", code="model_not_found")

    def max_new_tokens(self, requested: int | None, prompt_len: int, block_size: int, rule: str | None, param: str,
                       prompt_param: str) -> int:
        """`max_tokens` checked against the context (or, when not given, all the room the context leaves): whole
        blocks, or in exact mode all but the `block_size - 1` positions its last forward drafts."""
        if RULES[rule or self.options.rule].verifies:
            room, unit = self.context - prompt_len - (block_size - 1), f"{block_size - 1} positions for drafting"
        else:
            room, unit = (self.context - prompt_len) // block_size * block_size, f"whole blocks of {block_size}"
        if room < 1:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this model's context is {self.context} tokens "
                                f"and generation needs room for at least one token ({unit})",
                           param=prompt_param, code="context_length_exceeded")
        if requested is None:
            return room
        if requested > room:
            raise APIError(400, f"{param}={requested} is too large: this model's context is {self.context} tokens "
                                f"and the prompt has {prompt_len}; at most {room} new tokens fit "
                                f"({unit})", param=param, code="context_length_exceeded")
        return requested

    def sampling(self, req: SamplingFields) -> list[SamplingParams]:
        if getattr(req, "logprobs", None):
            raise APIError(400, "logprobs are not supported by this server", param="logprobs",
                           code="unsupported_parameter")
        stops = req.stop_strings()
        try:
            return [SamplingParams(
                temperature=self.temperature if req.temperature is None else req.temperature,
                top_p=self.top_p if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                repetition_penalty=req.repetition_penalty or 1.0,
                seed=None if req.seed is None else (req.seed + i) % 2**64, stop=stops) for i in range(req.n)]
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from exc

    def submit(self, prompt: list[int], max_new: int, sampling: list[SamplingParams],
               req: SamplingFields) -> RequestHandle:
        try:
            return self.scheduler.submit(prompt, max_new, sampling, block_size=req.block_size,
                                         threshold=req.threshold, rule=req.rule, ignore_eos=req.ignore_eos)
        except QueueFull as exc:
            raise APIError(429, f"{exc}; retry later", type="rate_limit_error", code="server_busy") from exc
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from exc
        except RuntimeError as exc:
            raise APIError(503, str(exc), type="server_error", code="unavailable") from exc

    def usage(self, prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # -- chat ----------------------------------------------------------------------------------------------------
    def chat_prompt(self, req: ChatCompletionRequest) -> tuple[list[int], str, bool, bool]:
        """(prompt ids, forced start of the answer, thinking, parse tool calls)."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        forced = ""
        if tools and req.tool_choice == "required":
            forced = CALL + "\n"
        elif isinstance(req.tool_choice, NamedToolChoice):
            forced = CALL + '\n{"name": ' + json.dumps(req.tool_choice.function.name) + ', "arguments": '
        thinking = req.enable_thinking and not forced  # a forced call answers at once
        try:
            text = self.tokenizer.render_chat([m.to_template() for m in req.messages], tools, thinking)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_value") from exc
        ids = self.tokenizer.encode(text + forced)
        return ids, forced, thinking, bool(tools) and req.tool_choice != "none"

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        if wants_decision(req):  # structured outputs: decision decoding (structured.py)
            return await decision_response(self, req)
        sampling = self.sampling(req)
        ids, forced, thinking, tools = await run_in_threadpool(self.chat_prompt, req)
        block = req.block_size or self.block_size
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        max_new = self.max_new_tokens(req.max_new_tokens(), len(ids), block, req.rule, param, "messages")
        handle = self.submit(ids, max_new, sampling, req)
        stops = req.stop_strings()
        choices = [_ChatChoice(self.tokenizer.decode, stops, thinking, tools, forced) for _ in range(req.n)]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._chat_stream(handle, choices, rid, created, len(ids), usage),
                                     media_type="text/event-stream")
        await self._collect(request, handle, lambda _, out: choices[out.choice].push_output(out))
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": self.options.served_model_name,
            "choices": [{"index": i, "message": c.message(), "finish_reason": c.finish_reason, "logprobs": None}
                        for i, c in enumerate(choices)],
            "usage": self.usage(len(ids), sum(c.tokens for c in choices), max(handle.cached_tokens)),
        })

    def _chunk(self, rid: str, obj: str, created: int, include_usage: bool, choice: dict[str, Any]) -> str:
        """One SSE chunk of a streamed response (chat or completion: they differ in `object` and the choice)."""
        body: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": self.options.served_model_name,
                                "choices": [{**choice, "logprobs": None}]}
        if include_usage:
            body["usage"] = None  # OpenAI: usage is null on every chunk but the final one
        return _sse(body)

    async def _chat_stream(self, handle: RequestHandle, choices: list[_ChatChoice], rid: str, created: int,
                           prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
        def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> str:
            return self._chunk(rid, "chat.completion.chunk", created, include_usage,
                               {"index": index, "delta": delta, "finish_reason": finish})

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
                    yield chunk(out.choice, {}, c.finish_reason)
            if include_usage:
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                            "model": self.options.served_model_name, "choices": [],
                            "usage": self.usage(prompt_tokens, sum(c.tokens for c in choices),
                                                max(handle.cached_tokens))})
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            logger.exception("generation failed")
            yield _sse(APIError(500, f"generation failed: {exc}", type="server_error", code="internal_error").body())
        finally:
            handle.cancel()  # no-op when finished; frees the slots when the client went away
        yield "data: [DONE]\n\n"

    # -- text completions ----------------------------------------------------------------------------------------
    def completion_prompts(self, req: CompletionRequest) -> list[tuple[list[int], str]]:
        out = []
        for p in req.prompts():
            if isinstance(p, str):
                out.append((self.tokenizer.encode(p), p))
            else:
                bad = [t for t in p if t >= len(self.tokenizer)]
                if bad:
                    raise APIError(400, f"prompt token ids must be < {len(self.tokenizer)}, got {bad[:5]}",
                                   param="prompt", code="invalid_value")
                out.append((list(p), self.tokenizer.decode(list(p)) if req.echo else ""))
        return out

    async def completion(self, req: CompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported by this server", param="suffix",
                           code="unsupported_parameter")
        if req.logprobs is not None:
            raise APIError(400, "logprobs are not supported by this server", param="logprobs",
                           code="unsupported_parameter")
        sampling = self.sampling(req)
        prompts = await run_in_threadpool(self.completion_prompts, req)
        block = req.block_size or self.block_size
        max_news = [self.max_new_tokens(req.max_new_tokens(), len(ids), block, req.rule, "max_tokens", "prompt")
                    for ids, _ in prompts]
        handles: list[RequestHandle] = []
        try:
            for (ids, _), max_new in zip(prompts, max_news):
                handles.append(self.submit(ids, max_new, sampling, req))
        except APIError:
            for h in handles:
                h.cancel()
            raise
        stops = req.stop_strings()
        choices = [_ChoiceText(self.tokenizer.decode, stops) for _ in range(len(prompts) * req.n)]
        texts = [prompts[i // req.n][1] if req.echo else "" for i in range(len(choices))]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_tokens = sum(len(ids) for ids, _ in prompts)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._completion_stream(handles, choices, texts, req.n, rid, created,
                                                             prompt_tokens, usage), media_type="text/event-stream")

        def take(i: int, out: Output) -> None:
            k = i * req.n + out.choice
            texts[k] += choices[k].push(out)

        await self._collect(request, handles, take)
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": created, "model": self.options.served_model_name,
            "choices": [{"index": k, "text": texts[k], "finish_reason": c.finish_reason, "logprobs": None}
                        for k, c in enumerate(choices)],
            "usage": self.usage(prompt_tokens, sum(c.tokens for c in choices),
                                sum(max(h.cached_tokens) for h in handles)),
        })

    async def _completion_stream(self, handles: list[RequestHandle], choices: list[_ChoiceText], echo: list[str],
                                 n: int, rid: str, created: int, prompt_tokens: int,
                                 include_usage: bool) -> AsyncIterator[str]:
        def chunk(index: int, text: str, finish: str | None = None) -> str:
            return self._chunk(rid, "text_completion", created, include_usage,
                               {"index": index, "text": text, "finish_reason": finish})

        try:
            for k, text in enumerate(echo):
                if text:
                    yield chunk(k, text)
            async for i, out in _merge(handles):
                k = i * n + out.choice
                text = choices[k].push(out)
                if text:
                    yield chunk(k, text)
                if out.finished:
                    yield chunk(k, "", choices[k].finish_reason)
            if include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created,
                            "model": self.options.served_model_name, "choices": [],
                            "usage": self.usage(prompt_tokens, sum(c.tokens for c in choices),
                                                sum(max(h.cached_tokens) for h in handles))})
        except Exception as exc:  # noqa: BLE001
            logger.exception("generation failed")
            yield _sse(APIError(500, f"generation failed: {exc}", type="server_error", code="internal_error").body())
        finally:
            for h in handles:
                h.cancel()
        yield "data: [DONE]\n\n"

    async def _collect(self, request: Request, handles: RequestHandle | list[RequestHandle],
                       take: Callable[[int, Output], Any]) -> None:
        """Run a non-streamed request to the end (`take(handle index, output)` for each output), or cancel it
        when the client disconnects first."""
        handles = handles if isinstance(handles, list) else [handles]

        async def consume() -> None:
            async for i, out in _merge(handles):
                take(i, out)

        work = asyncio.create_task(consume())
        watch = asyncio.create_task(_wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                for h in handles:
                    h.cancel()
        if work not in done:
            raise APIError(499, "client disconnected", type="client_closed_request", code="client_closed_request")
        exc = work.exception()
        if exc is not None:
            logger.error("generation failed: %s", exc)
            raise APIError(500, f"generation failed: {exc}", type="server_error", code="internal_error")


# -- app factory ---------------------------------------------------------------------------------------------------
def _load(directory: str | Path) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    from clover.model import CloverForBlockDiffusion
    from clover.tokenizer import load_tokenizer

    directory = Path(directory)
    model = CloverForBlockDiffusion.from_pretrained(directory)
    return model, load_tokenizer(directory), read_generation_defaults(directory)


def read_generation_defaults(directory: Path | None) -> dict[str, Any]:
    """A checkpoint's generation_config.json (sampling defaults such as `temperature`), or {}."""
    path = directory / "generation_config.json" if directory is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


class _Guard:
    """Pure ASGI middleware in front of every route: request id, API key, body size limit, the last stop for
    exceptions, request metrics.

    The body is read here (up to the limit) and replayed to the app, so an oversized body is refused before any
    parsing, whether or not the client sent a Content-Length. Every response carries an `x-request-id` header.

    An exception that no route turned into an error response becomes a 500 here, naming the request id (the log
    line with the traceback has it too), and the middleware returns normally. It must not reach the ASGI server:
    Starlette's `ServerErrorMiddleware` sends its 500 and then re-raises, and uvicorn answers a raise by dropping
    the connection without `Connection: close`, so a client reusing the keep-alive connection (httpx, the
    `openai` client) would fail on its next, valid request."""

    def __init__(self, app: Any, server: _Server) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in ROUTES else ("/v1/models/{model}" if path.startswith("/v1/models/") else "other")
        request_id = f"req_{uuid.uuid4().hex}"
        status: dict[str, int | None] = {"code": None, "left": None}

        async def send_counted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id.encode())]}
            await send(message)

        async def receive_watched() -> dict[str, Any]:
            message = await receive()
            if message["type"] == "http.disconnect":
                status["left"] = 499
            return message

        try:
            await self._guarded(scope, receive_watched, send_counted, path)
        except Exception:  # noqa: BLE001 - a bug: answered as a 500, the connection kept
            logger.exception("request %s: %s %s failed", request_id, scope.get("method"), path)
            if status["code"] is None:
                await _send_error(send_counted, APIError(
                    500, f"internal server error (request id {request_id})", type="server_error",
                    code="internal_error"))
            # else the response had started: it stays incomplete, and the ASGI server closes the connection
        finally:
            # no response started: the client closed the request (499, nginx's code), or sending the 500 failed
            code = status["code"] or status["left"] or 500
            self.server.metrics.requests.labels(route, str(code)).inc()

    async def _guarded(self, scope: dict[str, Any], receive: Callable, send: Callable, path: str) -> None:
        key = self.server.options.api_key
        if key and path != "/health":
            headers = dict(scope.get("headers") or [])
            scheme, _, token = headers.get(b"authorization", b"").strip().partition(b" ")
            # the scheme name is case-insensitive (RFC 7235 §2.1); the token is compared in constant time
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), key.encode()):
                await _send_error(send, APIError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                                                 type="invalid_request_error", code="invalid_api_key"))
                return
        limit = self.server.options.max_body_bytes
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > limit:
                await _send_error(send, APIError(413, f"request body larger than {limit} bytes",
                                                 code="request_too_large"))
                return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _send_error(send: Callable, error: APIError) -> None:
    payload = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first of pydantic's errors as a 400 naming the field, with an OpenAI-style code: `invalid_json`,
    `missing_required_parameter`, `invalid_type` (a string where a number belongs, ...), `invalid_unicode`
    (lone surrogates), `nesting_too_deep` (JSON values), else `invalid_value` (out of range, unknown role, ...)."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request", code="invalid_request")
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        reason = first.get("ctx", {}).get("error", first.get("msg"))
        return APIError(400, f"the request body is not valid JSON: {reason}", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(loc) or "body"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    code = ("missing_required_parameter" if kind == "missing"
            else kind if kind in ("invalid_unicode", "nesting_too_deep")  # protocol.py's own checks
            else "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value")
    return APIError(400, f"{where}: {first.get('msg')}{more}", param=where if loc else None, code=code)


def _http_error(exc: StarletteHTTPException) -> APIError:
    """Starlette's and FastAPI's own errors (unknown route, wrong method, a body the JSON parser refused)."""
    if exc.status_code == 400 and exc.__cause__ is not None:
        # FastAPI's "There was an error parsing the body": invalid UTF-8, an integer of more than 4300 digits,
        # nesting deeper than the parser's recursion limit. The cause says which.
        return APIError(400, f"the request body is not valid JSON: {exc.__cause__}", code="invalid_json")
    code = {404: "not_found", 405: "method_not_allowed"}.get(
        exc.status_code, "internal_error" if exc.status_code >= 500 else "invalid_request")
    return APIError(exc.status_code, str(exc.detail), code=code,
                    type="server_error" if exc.status_code >= 500 else "invalid_request_error")


def create_app(model: torch.nn.Module | str | Path, tokenizer: Any = None, options: ServerOptions | None = None,
               generation_defaults: dict[str, Any] | None = None) -> FastAPI:
    """The FastAPI app serving `model` (a loaded model with its `tokenizer`, or a checkpoint directory).

    `generation_defaults`: sampling defaults of a loaded model (a checkpoint directory's are read from its
    generation_config.json). The scheduler thread starts with the app (lifespan) and stops with it."""
    options = options or ServerOptions()
    defaults = generation_defaults or {}
    if isinstance(model, (str, Path)):
        model, loaded_tokenizer, defaults = _load(model)
        tokenizer = tokenizer or loaded_tokenizer
    else:
        if tokenizer is None:
            raise ValueError("create_app(model=<loaded model>) needs its tokenizer")
    server = _Server(model.eval(), tokenizer, options, defaults)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.scheduler.start()
        try:
            yield
        finally:
            await run_in_threadpool(server.scheduler.stop)

    app = FastAPI(title="Clover", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server for Clover block-diffusion models")
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_error(exc).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = _http_error(exc)
        return JSONResponse(error.body(), status_code=error.status, headers=getattr(exc, "headers", None))

    # any other exception: a 500 from `_Guard`, which keeps the connection (no handler for Exception here)

    @app.post("/v1/chat/completions", responses=ERRORS)
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(req, request)

    @app.post("/v1/completions", responses=ERRORS)
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await server.completion(req, request)

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
        if not server.scheduler.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok", **server.scheduler.load})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=server.metrics.content_type)

    app.add_middleware(_Guard, server=server)
    return app
