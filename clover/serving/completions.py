"""Text completions (`POST /v1/completions`), vLLM's `serving_completion`: tokenize each prompt (or take its ids),
check `max_tokens` against the context, submit one request per prompt (one sequence per choice), then stream the
committed blocks as SSE (`completion_stream`) or collect them into one body (the formats: `openai_format.py`). `echo` with `logprobs` scores the
prompts first (`prompt_logprobs`).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from clover.engine.logprobs import PromptScoring, TokenLogprob, banned_ids
from clover.engine.loops.loop import StreamPiece
from clover.serving.scheduling.handles import RequestHandle, merge
from clover.serving.api.openai_format import (ChoiceText, TokenTexts, chunk_sse, completion_body, completion_logprobs,
                                              sse, usage)
from clover.serving.api.protocol import APIError, CompletionRequest
from clover.serving.request_context import REQUEST_ID, internal_error, request_failure, unavailable
from clover.serving.scheduling.scheduler import QueueFull

if TYPE_CHECKING:
    from clover.serving.served_model import ServedModel

logger = logging.getLogger(__name__)


async def create_completion(server: ServedModel, req: CompletionRequest, request: Request) -> Response:
    server.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported by this server", param="suffix", code="unsupported_parameter")
    options = req.choice_options(server.request_options(req, thinking_budget=server.thinking_budget(req)))
    prompts = await run_in_threadpool(completion_prompts, server, req)
    max_news = [await server.max_new_tokens(req.max_new_tokens(), len(ids), req.block_size, req.rule, "max_tokens",
                                            "prompt")
                for ids, _ in prompts]
    # an echoed prompt's logprobs: one causal forward over each prompt (clover.engine.logprobs)
    scored = await prompt_logprobs(server, [ids for ids, _ in prompts], req.logprobs) \
        if req.echo and req.logprobs is not None else None
    handles: list[RequestHandle] = []
    try:
        for (ids, _), max_new in zip(prompts, max_news):
            handles.append(await server.submit(ids, max_new, options, req))
    except APIError:
        for h in handles:
            h.cancel()
        raise
    stops = req.stop_strings()
    choices = [ChoiceText(server.tokenizer.decode, stops) for _ in range(len(prompts) * req.n)]
    texts = [prompts[i // req.n][1] if req.echo else "" for i in range(len(choices))]
    echoed = [(prompts[k // req.n][0], scored[k // req.n]) for k in range(len(choices))] if scored else None
    rid, created, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), server.options.served_model_name
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    token_texts = server.tokenizer.token_texts if req.logprobs is not None else None
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(completion_stream(handles, choices, texts, req.n, rid, created, name, prompt_tokens,
                                                   include_usage, token_texts, echoed),
                                 media_type="text/event-stream")

    def take(i: int, piece: StreamPiece) -> None:
        k = i * req.n + handles[i].choice(piece)
        texts[k] += choices[k].push(piece)

    await server.collect(request, handles, take)
    logprobs = None
    if token_texts is not None:
        logprobs = [completion_logprobs([*(echoed[k][0] if echoed else []), *c.token_ids],
                                        [*(echoed[k][1] if echoed else []), *c.logprobs], token_texts)[0]
                    for k, c in enumerate(choices)]
    return JSONResponse(completion_body(rid, created, name, choices, texts,
                                        usage(prompt_tokens, sum(c.tokens for c in choices),
                                              sum(max(h.cached_tokens) for h in handles)), logprobs))


def completion_prompts(server: ServedModel, req: CompletionRequest) -> list[tuple[list[int], str]]:
    """(ids, text) per prompt: a string tokenized, a list of ids checked against the vocabulary (its text decoded
    only for `echo`)."""
    vocab = len(server.tokenizer)
    out = []
    for p in req.prompts():
        if isinstance(p, str):
            out.append((server.tokenizer.encode(p), p))
        else:
            bad = [t for t in p if t >= vocab]
            if bad:
                raise APIError(400, f"prompt token ids must be < {vocab}, got {bad[:5]}", param="prompt",
                               code="invalid_value")
            out.append((list(p), server.tokenizer.decode(list(p)) if req.echo else ""))
    return out


async def prompt_logprobs(server: ServedModel, prompts: list[list[int]], top: int) -> list[list[TokenLogprob | None]]:
    """Each prompt token's causal logprob after the ones before it (the first: None), computed on the scheduler's
    thread as a decision run is (it counts against `max_running` while it runs)."""
    config = server.config
    if not config.token_shift:
        raise APIError(400, "echo with logprobs needs a model whose output at a token predicts the next one "
                            "(token_shift); this one predicts each position at itself", param="echo",
                       code="unsupported_parameter")
    banned = banned_ids(config.mask_token_id, len(server.tokenizer), config.vocab_size)
    run = PromptScoring(server.runner, prompts, top, banned, server.options.prefill_chunk)
    try:
        scoring = server.scheduler.decide(run)
    except QueueFull as exc:
        raise APIError(429, f"{exc}; retry later", type="rate_limit_error", code="server_busy") from exc
    except RuntimeError as exc:
        raise unavailable() from exc
    try:
        return await scoring
    except Exception as exc:  # noqa: BLE001 - a step raised: our bug, named by the request id only
        logger.error("request %s: prompt scoring failed", REQUEST_ID.get(), exc_info=exc)
        raise internal_error() from None


async def completion_stream(handles: list[RequestHandle], choices: list[ChoiceText], echo: list[str], n: int,
                            rid: str, created: int, model: str, prompt_tokens: int, include_usage: bool,
                            texts: TokenTexts | None = None,
                            echo_logprobs: list[tuple[list[int], list[TokenLogprob | None]]] | None = None
                            ) -> AsyncIterator[str]:
    """A text completion's SSE events (choice `k` is choice `k % n` of prompt `k // n`), as `chat_stream`; with
    `texts`, each chunk carries its tokens' logprobs (`echo_logprobs[k]`: the echoed prompt's tokens and values)."""
    offsets = [0] * len(choices)

    def values(k: int, tokens: list[int], lps: Sequence[TokenLogprob | None] | None) -> dict[str, Any]:
        if texts is None or lps is None:
            return {}
        body, offsets[k] = completion_logprobs(tokens, lps, texts, offsets[k])
        return {"logprobs": body}

    def chunk(index: int, text: str, finish: str | None = None, extra: dict[str, Any] = {}) -> str:
        return chunk_sse(rid, "text_completion", created, model, include_usage,
                         {"index": index, "text": text, "finish_reason": finish, **extra})

    try:
        for k, text in enumerate(echo):
            lps = values(k, *echo_logprobs[k]) if echo_logprobs else {}
            if text or lps:
                yield chunk(k, text, extra=lps)
        async for i, out in merge(handles):
            k = i * n + handles[i].choice(out)
            text = choices[k].push(out)
            lps = values(k, out.token_ids, out.logprobs) if out.logprobs else {}
            if text or lps:
                yield chunk(k, text, extra=lps)
            if out.finished:
                yield chunk(k, "", choices[k].finish_reason, choices[k].extra)
        if include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": usage(prompt_tokens, sum(c.tokens for c in choices),
                                                     sum(max(h.cached_tokens) for h in handles))})
    except Exception as exc:  # noqa: BLE001
        logger.exception("request %s: generation failed", REQUEST_ID.get())
        yield sse(request_failure(exc).body())
    finally:
        for h in handles:
            h.cancel()
    yield "data: [DONE]\n\n"
