"""The served model (`ServedModel`): the server's options, the model with its tokenizer (behind a lock) and
scheduler, and what every generating route shares — the model id check, `max_tokens` against the context, the
sampling defaults, submission to the `Scheduler` (one background thread owns the model), and collecting a
non-streamed answer. The routes' own flows are `chat.py`, `completions.py` and `responses.py` (vLLM's
serving_chat / serving_completion / serving_responses).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from fastapi import Request
from starlette.concurrency import run_in_threadpool

from clover.choices import DRAFT_MEMORY, DRAFT_MEMORY_MODES, DRAFT_MEMORY_TOKENS
from clover.engine import RequestOptions, SamplingParams
from clover.engine.loops.loop import StreamPiece
from clover.engine.constraints.thinking import ThinkingBudget
from clover.model import CloverForBlockDiffusion
from clover.engine.runner import ModelRunner, as_runner
from clover.serving.draft_memories import DraftMemories
from clover.serving.scheduling.handles import RequestHandle, merge, until_disconnect
from clover.serving.locked_tokenizer import LockedTokenizer
from clover.serving.metrics import ServerMetrics
from clover.serving.scheduling.prefix_cache import PrefixCache
from clover.serving.api.protocol import APIError, DecodingFields, SamplingFields
from clover.serving.request_context import CLIENT_KEY, REQUEST_ID, request_failure, unavailable
from clover.serving.request_log import RequestLog
from clover.serving.response_store import ResponseStore
from clover.serving.scheduling.scheduler import QueueFull, Scheduler
from clover.tokenizer import eos_token_ids, load_tokenizer
from clover.tool_formats import TOOL_FORMATS

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
    draft_memory: str = DRAFT_MEMORY  # whose answers draft whose (clover.serving.draft_memories): per-key|shared|off
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
        # generation_config.json, else the engine's (greedy / no nucleus cut)
        engine = SamplingParams()
        self.sampling_defaults = {name: getattr(options, name) if getattr(options, name) is not None else
                                  float(generation_defaults.get(name) or getattr(engine, name))
                                  for name in ("temperature", "top_p")}
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

    def request_options(self, req: DecodingFields, **parts: Any) -> RequestOptions:
        """The request's options (`DecodingFields.to_options`) with this server's sampling defaults and the drafting
        memory of the key it came with (clover.serving.draft_memories); `parts`: what routing built (a grammar, a
        thinking budget)."""
        return req.to_options(self.sampling_defaults, memory=self.memories.for_request(), **parts)

    def thinking_budget(self, req: DecodingFields) -> ThinkingBudget | None:
        """The request's reasoning budget, closed with this template's own text (None: unbounded)."""
        if req.thinking_token_budget is None:
            return None
        return self.tokenizer.thinking_budget(req.thinking_token_budget)

    async def resolve_breakers(self, options: list[RequestOptions], block_size: int | None, rule: str | None) -> None:
        """DRY's sequence breakers resolved against the vocabulary now, in a worker thread (a pass over the
        vocabulary per breaker), so that the scheduler thread finds them in its engine's cache."""
        wanted = {o.sampling.dry_sequence_breakers for o in options
                  if o.sampling.uses_dry and o.sampling.dry_sequence_breakers}
        if wanted:
            _, engine = await self.scheduler.engine(block_size, rule)
            if engine.breakers is not None:
                for breakers in wanted:
                    await run_in_threadpool(engine.breakers, breakers)

    async def submit(self, prompt: list[int], max_new: int, options: list[RequestOptions],
                     req: SamplingFields, rule: str | None = None) -> RequestHandle:
        """One prompt queued with `options` per choice, on the engine of the request's block size and `rule`
        (None: the request's); the scheduler's refusals as API errors."""
        try:
            await self.resolve_breakers(options, req.block_size, rule or req.rule)
            return await self.scheduler.submit(prompt, max_new, options, block_size=req.block_size,
                                               rule=rule or req.rule, scope=CLIENT_KEY.get())
        except QueueFull as exc:
            raise APIError(429, f"{exc}; retry later", type="rate_limit_error", code="server_busy") from exc
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from exc
        except RuntimeError as exc:
            raise unavailable() from exc


    async def collect(self, request: Request, handles: RequestHandle | list[RequestHandle],
                      take: Callable[[int, StreamPiece], Any]) -> None:
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
