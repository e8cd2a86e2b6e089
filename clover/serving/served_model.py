"""The served model: the server's options, the model with its tokenizer (behind a lock) and scheduler, and the
request flow from a validated request to engine work and back to a response.

(Over the ~450-line mark, for now: the chat and text-completion flows share its options, tokenizer lock and
submission; splitting them into chat / completions modules beside the scheduler, as vLLM's serving_chat /
serving_completion, waits for the serving folder's reorganisation, issue 54.)

`ServedModel.chat` / `.completion`: check the model id and sampling fields, render the chat template and tokenize
(in a worker thread), check `max_tokens` against the context, submit to the `Scheduler` (one background thread
owns the model), then stream the committed blocks as SSE or collect them into one body (`openai_format.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from fastapi import Request
from jinja2.exceptions import TemplateError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from clover.chat_template import checkpoint_template, opens_reasoning, render_chat
from clover.choices import DRAFT_MEMORY_MODES, DRAFT_MEMORY_TOKENS
from clover.engine import SamplingParams
from clover.engine.logprobs import PromptScoring, TokenLogprob, banned_ids
from clover.engine.thinking import ThinkingBudget, thinking_budget
from clover.model import CloverForBlockDiffusion
from clover.runners.base import ModelRunner
from clover.runners.torch_runner import as_runner
from clover.serving.handles import Output, RequestHandle, merge, until_disconnect
from clover.serving.metrics import ServerMetrics
from clover.serving.openai_format import (ChatChoice, ChoiceText, chat_body, chat_logprobs, chat_stream,
                                          completion_body, completion_logprobs, completion_stream, usage)
from clover.serving.prefix_cache import PrefixCache
from clover.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest, DecodingFields, SamplingFields
from clover.serving.draft_memories import DraftMemories
from clover.serving.request_context import (CLIENT_KEY, GRAMMAR_PARAM, REQUEST_ID, internal_error,
                                            request_failure, unavailable)
from clover.serving.request_log import RequestLog
from clover.serving.response_store import ResponseStore
from clover.serving.scheduler import QueueFull, Scheduler
from clover.serving.grammar_route import forced_start, grammar_param, max_calls, request_grammar, route
from clover.serving.structured import decision_response
from clover.tokenizer import eos_token_ids, load_tokenizer
from clover.tool_formats import TOOL_FORMATS, detect

logger = logging.getLogger(__name__)


@dataclass
class ServerOptions:
    served_model_name: str = "clover"  # the model id of responses and /v1/models
    model_aliases: tuple[str, ...] = ()  # other ids requests may name (the default model: its versioned id)
    api_key: str | tuple[str, ...] | None = None  # every route but /health then needs `Authorization: Bearer <key>`
    # with one of these keys
    max_running: int = 32  # sequences decoded together
    max_waiting: int = 256  # more sequences queued before 429
    max_body_bytes: int = 4 * 2**20
    max_model_len: int | None = None  # context served (default and cap: the model's max_position_embeddings)
    block_size: int | None = None  # defaults: the model's config
    threshold: float | None = None
    rule: str | None = None  # None: the model's config (clover-smol: exact)
    prefill_chunk: int = 256  # prompt tokens per prefill forward = the prefix cache's grid
    prefix_cache_bytes: int = 512 * 2**20  # 0: no prefix reuse; the default: docs/serving.md "Budget"
    prefix_snapshot_interval: int | None = None  # hybrid models: recurrent snapshots every this many tokens
    temperature: float | None = None  # default when a request gives none: generation_config.json, else 0
    top_p: float | None = None
    chat_template: str | None = None  # None: the checkpoint's own (Clover's for a checkpoint without one)
    tool_call_parser: str | None = None  # None: the one the template writes (clover.tool_formats.detect)
    responses_store_bytes: int = 64 * 2**20  # stored responses (`previous_response_id`), as JSON; 0: none kept
    draft_memory: str = "per-key"  # whose answers draft whose (clover.serving.draft_memories): per-key|shared|off
    draft_memory_tokens: int = DRAFT_MEMORY_TOKENS  # tokens each drafting memory keeps
    record_requests: str | None = None  # a JSON-lines file every finished sequence is appended to (request_log.py)

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The keys a request may carry (none: no key needed)."""
        return (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key or ())

    def __post_init__(self) -> None:
        if any(not key for key in self.api_keys):
            raise ValueError("ServerOptions.api_key: an API key cannot be empty")
        if self.draft_memory not in DRAFT_MEMORY_MODES:
            raise ValueError(f"ServerOptions.draft_memory must be one of {', '.join(DRAFT_MEMORY_MODES)}, "
                             f"got {self.draft_memory!r}")
        if self.draft_memory_tokens < 1:
            raise ValueError(f"ServerOptions.draft_memory_tokens must be >= 1, got {self.draft_memory_tokens}")
        for name in ("max_running", "max_body_bytes", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerOptions.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting < 0 or self.prefix_cache_bytes < 0 or self.responses_store_bytes < 0:
            raise ValueError("ServerOptions.max_waiting, prefix_cache_bytes and responses_store_bytes must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"ServerOptions.max_model_len must be >= 1, got {self.max_model_len}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_FORMATS:
            raise ValueError(f"ServerOptions.tool_call_parser must be one of {sorted(TOOL_FORMATS)}, "
                             f"got {self.tool_call_parser!r}")


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character a byte-level BPE writes for each byte
    (printable Latin-1 bytes as themselves, the others shifted to 256 and up) -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(shifted)}}


_UNICODE_BYTE = _byte_alphabet()


class LockedTokenizer:
    """The tokenizer behind one lock: a fast tokenizer may refuse concurrent use from several threads (its
    Rust object is borrowed mutably when encoding), and the scheduler thread decodes for stop strings. It renders
    chats with `template` and knows the call format that template writes (`tool_format`)."""

    def __init__(self, tokenizer: Any, template: str | None = None, tool_call_parser: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.lock = threading.Lock()
        self.template = template or checkpoint_template(tokenizer)
        self.tool_format = TOOL_FORMATS[tool_call_parser] if tool_call_parser else detect(self.template)
        self._budget: ThinkingBudget | None = None  # the tags' ids and the template's closing, made on first use

    def encode(self, text: str) -> list[int]:
        with self.lock:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        with self.lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text (special tokens spelled out): how logprobs name tokens."""
        with self.lock:
            return self.tokenizer.batch_decode([[i] for i in ids])

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """Each token's own bytes (logprobs' `bytes`): a byte-level token that holds part of a character decodes
        to U+FFFD, so its bytes are read from its vocabulary entry (GPT-2's byte alphabet, or a `<0xNN>` byte
        token), not from its text."""
        texts = self.token_texts(ids)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return [t.encode("utf-8") for t in texts]
        with self.lock:
            pieces = [backend.id_to_token(i) for i in ids]
        byte_level = type(backend.decoder).__name__ == "ByteLevel"
        out = []
        for text, piece in zip(texts, pieces):
            if byte_level and piece is not None and all(c in _UNICODE_BYTE for c in piece):
                out.append(bytes(_UNICODE_BYTE[c] for c in piece))
            elif piece is not None and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
                out.append(bytes([int(piece[3:5], 16)]))
            else:
                out.append(text.encode("utf-8"))
        return out

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    thinking: bool | None, template_kwargs: dict[str, Any]) -> str:
        with self.lock:
            return render_chat(self.tokenizer, messages, tools, add_generation_prompt=True, enable_thinking=thinking,
                               template=self.template, **template_kwargs)

    def thinking_budget(self, tokens: int) -> ThinkingBudget:
        """A budget of `tokens` reasoning tokens, closed with this template's own closing text
        (clover.engine.thinking)."""
        if self._budget is None:
            with self.lock:
                self._budget = thinking_budget(0, self.tokenizer, self.template)
        return dataclasses.replace(self._budget, tokens=tokens)

    def __len__(self) -> int:
        return len(self.tokenizer)


@dataclass
class ChatRun:
    """A submitted chat request: its handle, one `ChatChoice` per choice (fed with the handle's outputs by whoever
    reads it), and its prompt's length in tokens."""

    handle: RequestHandle
    choices: list[ChatChoice]
    prompt_tokens: int


# -- the server ----------------------------------------------------------------------------------------------------
class ServedModel:
    """One served model: its tokenizer and scheduler, and what turns a request into engine work and back."""

    def __init__(self, model: torch.nn.Module | ModelRunner, tokenizer: Any, options: ServerOptions,
                 generation_defaults: dict[str, Any]) -> None:
        self.runner = as_runner(model)
        config = self.runner.config
        self.options, self.config = options, config
        self.tokenizer = LockedTokenizer(tokenizer, options.chat_template, options.tool_call_parser)
        limit = self.runner.max_context
        self.context = min(options.max_model_len or limit, limit)
        # what a request that gives no temperature or top_p gets: the server's option, else the checkpoint's
        # generation_config.json, else greedy / no nucleus cut
        self.sampling_defaults = {
            "temperature": options.temperature if options.temperature is not None else
            float(generation_defaults.get("temperature") or 0.0),
            "top_p": options.top_p if options.top_p is not None else float(generation_defaults.get("top_p") or 1.0)}
        eos = eos_token_ids(config, tokenizer)
        prefix_cache = None
        # a runner without prefix reuse (a hybrid model on llama.cpp: no recurrent state mid-sequence) serves without
        if options.prefix_cache_bytes > 0 and getattr(self.runner, "prefix_reuse", True):
            prefix_cache = PrefixCache(options.prefill_chunk, options.prefix_cache_bytes,
                                       recurrent=config.has_linear_attention,
                                       snapshot_interval=options.prefix_snapshot_interval)
        self.memories = DraftMemories(options.draft_memory, options.draft_memory_tokens)
        self.metrics = ServerMetrics(self.memories.tokens_of, prefix_cache.entries_of if prefix_cache else None)
        # the default engine (its block size, threshold and rule checked) is made when the scheduler starts, on
        # its thread
        self.scheduler = Scheduler(
            self.runner, block_size=options.block_size, threshold=options.threshold, rule=options.rule,
            eos_token_ids=eos, vocab_limit=len(self.tokenizer), detokenize=self.tokenizer.decode,
            prefill_chunk=options.prefill_chunk, prefix_cache=prefix_cache, max_running=options.max_running,
            max_waiting=options.max_waiting, metrics=self.metrics,
            request_log=RequestLog(options.record_requests) if options.record_requests else None)
        self.stored = ResponseStore(options.responses_store_bytes)  # the Responses API's (responses.py)
        self.created = int(time.time())

    # -- request -> engine ---------------------------------------------------------------------------------
    @property
    def model_names(self) -> list[str]:
        return [self.options.served_model_name, *self.options.model_aliases]

    def check_model(self, name: str) -> None:
        if name not in self.model_names:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{' or '.join(map(repr, self.model_names))}", param="model", code="model_not_found")

    async def max_new_tokens(self, requested: int | None, prompt_len: int, block_size: int | None,
                             rule: str | None, param: str, prompt_param: str) -> int:
        """`max_tokens` checked against the context (or, when not given, all the room the context leaves), as the
        engine's loop counts the positions it needs (`DecodingLoop.room`)."""
        try:
            _, engine = await self.scheduler.engine(block_size, rule)
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from exc
        except RuntimeError as exc:
            raise unavailable() from exc
        room, unit = engine.loop.room(self.context, prompt_len, engine.block_size)
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

    def temperature_and_top_p(self, req: DecodingFields) -> dict[str, float]:
        """The request's temperature and top_p, the server's defaults (`sampling_defaults`) where it gives none."""
        return {name: default if getattr(req, name) is None else getattr(req, name)
                for name, default in self.sampling_defaults.items()}

    def sampling(self, req: ChatCompletionRequest | CompletionRequest) -> list[SamplingParams]:
        stops = req.stop_strings()
        budget = None
        if req.thinking_token_budget is not None:
            if req.logprobs_top() is not None:
                raise APIError(400, "thinking_token_budget cannot be combined with logprobs (the closing tokens it "
                                    "forces are decided without the model's logits)", param="thinking_token_budget",
                               code="unsupported_parameter")
            budget = self.tokenizer.thinking_budget(req.thinking_token_budget)
        try:
            return [SamplingParams(
                **self.temperature_and_top_p(req), top_k=req.top_k or 0,
                repetition_penalty=req.repetition_penalty or 1.0,
                seed=None if req.seed is None else (req.seed + i) % 2**64, stop=stops, logprobs=req.logprobs_top(),
                thinking_budget=budget, **req.repetition())
                for i in range(req.n)]
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from exc

    def _grammar(self, req: ChatCompletionRequest) -> Any:
        with self.tokenizer.lock:
            return request_grammar(req, self.tokenizer.tokenizer, self.tokenizer.tool_format)

    async def resolve_breakers(self, sampling: list[SamplingParams], block_size: int | None, rule: str | None) -> None:
        """DRY's sequence breakers resolved against the vocabulary now, in a worker thread (a pass over the
        vocabulary per breaker), so that the scheduler thread finds them in its engine's cache."""
        wanted = {p.dry_sequence_breakers for p in sampling if p.uses_dry and p.dry_sequence_breakers}
        if wanted:
            _, engine = await self.scheduler.engine(block_size, rule)
            if engine.breakers is not None:
                for breakers in wanted:
                    await run_in_threadpool(engine.breakers, breakers)

    async def submit(self, prompt: list[int], max_new: int, sampling: list[SamplingParams],
                     req: SamplingFields, rule: str | None = None) -> RequestHandle:
        try:
            await self.resolve_breakers(sampling, req.block_size, rule or req.rule)
            return await self.scheduler.submit(prompt, max_new, sampling, block_size=req.block_size,
                                               threshold=req.threshold, rule=rule or req.rule,
                                               ignore_eos=req.ignore_eos, memory=self.memories.for_request(),
                                               scope=CLIENT_KEY.get())
        except QueueFull as exc:
            raise APIError(429, f"{exc}; retry later", type="rate_limit_error", code="server_busy") from exc
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from exc
        except RuntimeError as exc:
            raise unavailable() from exc


    # -- chat ----------------------------------------------------------------------------------------------------
    def chat_prompt(self, req: ChatCompletionRequest, constrained: bool = False) -> tuple[list[int], str, bool, bool]:
        """(prompt ids, forced start of the answer, thinking, parse tool calls). `constrained`: a grammar writes the
        answer (no reasoning first)."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        forced = forced_start(req, self.tokenizer.tool_format)
        # a grammar answers at once: no reasoning first, whatever the template's default
        enable = False if forced or constrained else req.enable_thinking
        kwargs = req.chat_template_kwargs.extra() if req.chat_template_kwargs else {}
        try:
            text = self.tokenizer.render_chat([m.to_template() for m in req.messages], tools, enable, kwargs)
        except (ValueError, TemplateError) as exc:  # the checkpoint's template may refuse a conversation itself
            raise APIError(400, f"the chat template cannot render these messages: {exc}" if isinstance(
                exc, TemplateError) else str(exc), param="messages", code="invalid_value") from exc
        ids = self.tokenizer.encode(text + forced)
        return ids, forced, opens_reasoning(text), bool(tools) and req.tool_choice != "none"

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        path = route(req)
        if path == "decision":  # structured outputs in the form subset: decision decoding (structured.py)
            if req.logprobs:
                raise APIError(400, "logprobs cannot be combined with a response_format served by decision mode "
                                    "(its slots are scored as whole values); pass structured_mode 'grammar'",
                               param="logprobs", code="unsupported_parameter")
            return await decision_response(self, req, request)
        run = await self.start_chat(req, path)
        handle, choices = run.handle, run.choices
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(chat_stream(handle, choices, rid, created, self.options.served_model_name,
                                                 run.prompt_tokens, include_usage, self.tokenizer.token_texts,
                                                 self.tokenizer.token_bytes),
                                     media_type="text/event-stream")
        await self.collect(request, handle, lambda _, out: choices[out.choice].push_output(out))
        logprobs = ([chat_logprobs(c.logprobs, self.tokenizer.token_texts, self.tokenizer.token_bytes)
                     for c in choices] if req.logprobs
                    else None)
        return JSONResponse(chat_body(rid, created, self.options.served_model_name, choices,
                                      usage(run.prompt_tokens, sum(c.tokens for c in choices),
                                            max(handle.cached_tokens)), logprobs))

    async def start_chat(self, req: ChatCompletionRequest, path: str | None) -> ChatRun:
        """A chat request that `route` sends to free generation (None) or the grammar ("grammar"), submitted: its
        prompt rendered, `max_tokens` checked, the work queued. The caller reads the run (or cancels it)."""
        assert path != "decision", "decision mode answers whole (structured.py)"
        sampling = self.sampling(req)
        rule = req.rule
        if path == "grammar":  # grammar-constrained decoding, in exact mode (grammar_route.py)
            GRAMMAR_PARAM.set(grammar_param(req))  # in this request's context: what its failure names
            grammar = await run_in_threadpool(self._grammar, req)
            # a grammar's answer is rendered without reasoning: no budget to keep (clover.engine.thinking)
            sampling = [dataclasses.replace(p, grammar=grammar, thinking_budget=None) for p in sampling]
            rule = rule or "exact"
        ids, forced, thinking, tools = await run_in_threadpool(self.chat_prompt, req, path == "grammar")
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        max_new = await self.max_new_tokens(req.max_new_tokens(), len(ids), req.block_size, rule, param,
                                            "messages")
        handle = await self.submit(ids, max_new, sampling, req, rule)
        stops = req.stop_strings()
        schemas = {t.function.name: t.function.parameters for t in req.tools or []}
        choices = [ChatChoice(self.tokenizer.decode, stops, thinking, tools, forced, max_calls(req),
                              self.tokenizer.tool_format, schemas) for _ in range(req.n)]
        return ChatRun(handle, choices, len(ids))


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
        sampling = self.sampling(req)
        prompts = await run_in_threadpool(self.completion_prompts, req)
        max_news = [await self.max_new_tokens(req.max_new_tokens(), len(ids), req.block_size, req.rule,
                                              "max_tokens", "prompt")
                    for ids, _ in prompts]
        # an echoed prompt's logprobs: one causal forward over each prompt (clover.engine.logprobs)
        scored = await self.prompt_logprobs([ids for ids, _ in prompts], req.logprobs) \
            if req.echo and req.logprobs is not None else None
        handles: list[RequestHandle] = []
        try:
            for (ids, _), max_new in zip(prompts, max_news):
                handles.append(await self.submit(ids, max_new, sampling, req))
        except APIError:
            for h in handles:
                h.cancel()
            raise
        stops = req.stop_strings()
        choices = [ChoiceText(self.tokenizer.decode, stops) for _ in range(len(prompts) * req.n)]
        texts = [prompts[i // req.n][1] if req.echo else "" for i in range(len(choices))]
        echoed = [(prompts[k // req.n][0], scored[k // req.n]) for k in range(len(choices))] if scored else None
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_tokens = sum(len(ids) for ids, _ in prompts)
        token_texts = self.tokenizer.token_texts if req.logprobs is not None else None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(completion_stream(handles, choices, texts, req.n, rid, created,
                                                       self.options.served_model_name, prompt_tokens, include_usage,
                                                       token_texts, echoed),
                                     media_type="text/event-stream")

        def take(i: int, out: Output) -> None:
            k = i * req.n + out.choice
            texts[k] += choices[k].push(out)

        await self.collect(request, handles, take)
        logprobs = None
        if token_texts is not None:
            logprobs = [completion_logprobs([*(echoed[k][0] if echoed else []), *c.token_ids],
                                            [*(echoed[k][1] if echoed else []), *c.logprobs], token_texts)[0]
                        for k, c in enumerate(choices)]
        return JSONResponse(completion_body(rid, created, self.options.served_model_name, choices, texts,
                                            usage(prompt_tokens, sum(c.tokens for c in choices),
                                                  sum(max(h.cached_tokens) for h in handles)), logprobs))

    async def prompt_logprobs(self, prompts: list[list[int]], top: int) -> list[list[TokenLogprob | None]]:
        """Each prompt token's causal logprob after the ones before it (the first: None), computed on the
        scheduler's thread as a decision run is (it counts against `max_running` while it runs)."""
        config = self.config
        if not config.token_shift:
            raise APIError(400, "echo with logprobs needs a model whose output at a token predicts the next one "
                                "(token_shift); this one predicts each position at itself", param="echo",
                           code="unsupported_parameter")
        banned = banned_ids(config.mask_token_id, len(self.tokenizer), config.vocab_size)
        run = PromptScoring(self.runner, prompts, top, banned, self.options.prefill_chunk)
        try:
            scoring = self.scheduler.decide(run)
        except QueueFull as exc:
            raise APIError(429, f"{exc}; retry later", type="rate_limit_error", code="server_busy") from exc
        except RuntimeError as exc:
            raise unavailable() from exc
        try:
            return await scoring
        except Exception as exc:  # noqa: BLE001 - a step raised: our bug, named by the request id only
            logger.error("request %s: prompt scoring failed", REQUEST_ID.get(), exc_info=exc)
            raise internal_error() from None


    async def collect(self, request: Request, handles: RequestHandle | list[RequestHandle],
                      take: Callable[[int, Output], Any]) -> None:
        """Run a non-streamed request to the end (`take(handle index, output)` for each output), or cancel it
        when the client disconnects first."""
        handles = handles if isinstance(handles, list) else [handles]

        async def consume() -> None:
            async for i, out in merge(handles):
                take(i, out)

        try:
            work = await until_disconnect(request, consume())
        finally:
            for h in handles:  # a no-op for a finished handle; frees what still runs after a failure or a departure
                h.cancel()
        exc = work.exception()
        if exc is not None:
            logger.error("request %s: generation failed", REQUEST_ID.get(), exc_info=exc)
            raise request_failure(exc)


def load(directory: str | Path) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    directory = Path(directory)
    model = CloverForBlockDiffusion.from_pretrained(directory)
    return model, load_tokenizer(directory), read_generation_defaults(directory)


def read_generation_defaults(directory: Path | None) -> dict[str, Any]:
    """A checkpoint's generation_config.json (sampling defaults such as `temperature`), or {} when it has none.
    One that cannot be read, or is not a JSON object, is an error naming the file: serving it as greedy decoding
    would silently change what the checkpoint asks for."""
    path = directory / "generation_config.json" if directory is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        defaults = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(defaults, dict):
        raise ValueError(f"{path}: expected a JSON object of generation defaults, got {type(defaults).__name__}")
    for name in ("temperature", "top_p"):
        value = defaults.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{path}: {name} must be a number, got {value!r}")
    return defaults
