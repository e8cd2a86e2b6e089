"""Clover's decoding engine: block-diffusion generation with a cache, batching and streaming.

    from clover.engine import generate, stream
    result = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=64, block_size=16, threshold=0.9)
    result.sequences   # new token ids per prompt, EOS and what follows excluded
    result.stats       # per prompt: tokens, forward_passes, tokens_per_forward, wall_time_s, ...
    for piece in stream(model, [1, 2, 3], max_new_tokens=64):
        print(piece.token_ids)  # one block's committed tokens at a time

Roles: `engine` (requests in, pieces out), `request` (`RequestOptions`: what a request asks, checked once;
`Sequence`: one request's state and stats), `prefill` (the chunked prompt read generation and decision mode share),
`decoding` (rules, by name), `sampling` (SamplingParams, logits -> candidates + confidence), `noise` (sampling's
noise, keyed by seed and position), `logprobs` (the emitted tokens' log-probabilities, when a request asks:
`RequestOptions.logprobs`; an echoed prompt's scoring), `detokenizer` (ids -> text, incrementally), `reference` (the
uncached recompute decoder the tests compare against); `loops` (what a step does: `loop` the interface,
`block_loop` block diffusion, `exact` exact mode with `speculative` its acceptance of sampled tokens, `decision`
decision mode), `drafts` (exact mode's drafts: `lookup` + `draft_memory` copy them from the request's context and
from earlier answers, `drafting` + `cost` say how many pay), `constraints` (what bounds the output: `grammar` a JSON
Schema or a tool call, `thinking` a thinking budget, `repetition` DRY and the loop guard, `form` decision mode's
forms), `runner` (the interface the network runs behind: `ModelRunner`, its cache, and `ModuleRunner`, any module
with Clover's forward signature). The engine imports no model: every entry point takes a module (the torch model, run
as it is) or a runner of `clover.runners` (the torch runner opened from a checkpoint, llama.cpp for a GGUF).
Semantics and measured figures: docs/decoding.md.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Iterator, Sequence as Seq

import torch

from clover.engine.decoding import RULES, ExactRule, UnmaskingRule, make_rule, register_rule
from clover.engine.detokenizer import IncrementalDetokenizer, StopAwareDetokenizer
from clover.engine.engine import DEFAULT_PREFILL_CHUNK, Engine
from clover.engine.loops.loop import Event, StepSnapshot, StreamPiece
from clover.engine.request import Detokenize, Options, RequestOptions
from clover.engine.runner import ModelRunner, ModuleRunner
from clover.engine.sampling import SamplingParams

__all__ = [
    "DEFAULT_PREFILL_CHUNK", "Engine", "GenerationResult", "IncrementalDetokenizer", "ModelRunner", "ModuleRunner",
    "RULES", "RequestOptions", "SamplingParams", "StepSnapshot", "StopAwareDetokenizer", "StreamPiece",
    "UnmaskingRule", "generate", "make_rule", "register_rule", "stream",
]


@dataclass
class GenerationResult:
    sequences: list[list[int]]  # new token ids per prompt; EOS and anything after it excluded
    stats: list[dict[str, Any]]  # per prompt (see `Sequence.stats`)


def _options(options: Options | Seq[Options] | None, kwargs: dict[str, Any]) -> Options | list[Options]:
    if options is not None:
        if kwargs:
            raise TypeError("pass request options either as `options=RequestOptions(...)` or as keywords, not both")
        return options if isinstance(options, (RequestOptions, SamplingParams)) else list(options)
    return RequestOptions.of(**kwargs)


def _prompts(prompts: Any, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """A list of token-id lists, one list of ids (one prompt), or a 2-D tensor (rows; `attention_mask` strips
    left padding)."""
    if torch.is_tensor(prompts):
        if prompts.dim() == 1:
            prompts = prompts[None]
        if prompts.dim() != 2:
            raise ValueError(f"input_ids must be a 2-D tensor [batch, tokens], got shape {tuple(prompts.shape)}")
        rows = prompts.tolist()
        if attention_mask is not None:
            if attention_mask.shape != prompts.shape:
                raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids "
                                 f"{tuple(prompts.shape)}")
            keep = attention_mask.bool().tolist()
            rows = [[t for t, k in zip(row, m) if k] for row, m in zip(rows, keep)]
        return rows
    prompts = list(prompts)
    if prompts and all(isinstance(t, numbers.Integral) for t in prompts):
        return [prompts]
    return [list(p) for p in prompts]


def generate(model: torch.nn.Module | ModelRunner, prompts: Any, max_new_tokens: int = 128, *, block_size: int | None = None,
             threshold: float | None = None, rule: str | UnmaskingRule | ExactRule | None = None,
             rule_options: dict[str, Any] | None = None, options: Options | Seq[Options] | None = None,
             attention_mask: torch.Tensor | None = None, detokenize: Detokenize | None = None,
             vocab_limit: int | None = None, eos_token_ids: Seq[int] | None = None,
             prefill_chunk: int = DEFAULT_PREFILL_CHUNK, **keywords: Any) -> GenerationResult:
    """Generate for a batch of prompts (decoded together, each getting what it would get alone).

    `block_size`, `threshold` and `rule` default to the model config's. A request's options:
    `options=RequestOptions(...)` (one, or one per prompt; bare `SamplingParams` ask nothing else) or their fields
    as keywords: `temperature`, `top_p`, `top_k`, `repetition_penalty`, `seed`, `stop`, DRY's `dry_*` and the loop
    guard's `loop_guard_*` (docs/decoding.md "Repetition"), `grammar`, `thinking_budget`, `logprobs`, ...
    """
    rows = _prompts(prompts, attention_mask)
    engine = Engine(model, block_size, threshold, rule, rule_options, eos_token_ids=eos_token_ids,
                    vocab_limit=vocab_limit, detokenize=detokenize, prefill_chunk=prefill_chunk)
    sequences: list[list[int]] = [[] for _ in rows]
    stats: list[dict[str, Any]] = [{} for _ in rows]
    for event in engine.run(rows, max_new_tokens, _options(options, keywords)):
        if isinstance(event, StreamPiece):
            sequences[event.seq_id].extend(event.token_ids)
            if event.stats is not None:
                stats[event.seq_id] = event.stats
    return GenerationResult(sequences, stats)


def stream(model: torch.nn.Module | ModelRunner, prompt_ids: Seq[int] | torch.Tensor, max_new_tokens: int = 128, *,
           block_size: int | None = None, threshold: float | None = None,
           rule: str | UnmaskingRule | ExactRule | None = None,
           rule_options: dict[str, Any] | None = None, options: Options | None = None,
           detokenize: Detokenize | None = None, vocab_limit: int | None = None,
           eos_token_ids: Seq[int] | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
           snapshots: bool = False, **keywords: Any) -> Iterator[Event]:
    """Decode one prompt, yielding a `StreamPiece` (the block's committed ids) as each block is final; the last
    piece has `finished=True` and the request's `stats`. With `snapshots=True`, also a `StepSnapshot` after every
    denoising step. Detokenise in the caller (`IncrementalDetokenizer`)."""
    ids = prompt_ids.tolist() if torch.is_tensor(prompt_ids) else list(prompt_ids)
    if ids and isinstance(ids[0], list):
        if len(ids) != 1:
            raise ValueError(f"stream decodes one prompt, got {len(ids)}; use Engine.run for batches")
        ids = ids[0]
    engine = Engine(model, block_size, threshold, rule, rule_options, eos_token_ids=eos_token_ids,
                    vocab_limit=vocab_limit, detokenize=detokenize, prefill_chunk=prefill_chunk)
    return engine.run([ids], max_new_tokens, _options(options, keywords), snapshots=snapshots)
