"""The engine's naive reference: block decoding without a cache, slow and obvious, for tests to compare against.

`recompute_decode` decodes one prompt greedily with an unmasking rule. Every step runs the whole sequence again —
prompt read causally, committed blocks, then the current block with masks where it is undecided — and reads the
prediction for block position `p` from the output one position to its left (token shift). A step's candidates
are the masked positions before the block's `limit` (`min(B, tokens still allowed)`) and before the first
decided EOS; the rule picks among them by confidence (the maximum probability, mask id excluded). A block ends
when no candidate is left; EOS and what follows are dropped. The fast path (`Engine`, with its cache, lockstep
batches and skipped forwards) must give the same tokens and steps: "cached equals uncached".

`forwards` is what the cached engine needs for the same steps: one per step, except a step (not the block's
first) whose only candidate is position 0, whose prediction comes from committed tokens alone and is reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from clover.engine.decoding import UnmaskingRule


@dataclass
class ReferenceResult:
    tokens: list[int]  # new tokens, EOS and what follows excluded
    steps_per_block: list[int]
    forwards: int


@torch.inference_mode()
def recompute_decode(model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int, block_size: int,
                     rule: UnmaskingRule, eos_ids: Sequence[int]) -> ReferenceResult:
    """Greedy block decoding of `prompt` with `rule`, recomputing the whole sequence at every step."""
    mask, n, prompt = model.config.mask_token_id, len(prompt), list(prompt)
    generated: list[int] = []
    steps_per_block: list[int] = []
    forwards = 0
    while True:
        limit = min(block_size, max_new_tokens - len(generated))
        block = [mask] * block_size
        steps = 0
        while True:
            need = limit
            for i, t in enumerate(block):
                if t != mask and t in eos_ids:
                    need = min(need, i + 1)
                    break
            candidates = torch.tensor([[t == mask and i < need for i, t in enumerate(block)]])
            if not candidates.any():
                break
            seq = torch.tensor([prompt + generated + block])
            logits = model(seq, block_size=block_size, prefix_len=n).logits[0]
            start = n + len(generated)
            pred = logits[start - 1: start + block_size - 1].float()
            pred[:, mask] = float("-inf")
            conf, tokens = pred.softmax(-1).max(-1)
            accept = rule.select(tokens[None], conf[None], candidates)[0]
            forwards += steps == 0 or bool(candidates[0, 1:].any())
            block = [int(tokens[i]) if accept[i] else block[i] for i in range(block_size)]
            steps += 1
        steps_per_block.append(steps)
        piece = block[:limit]
        eos = next((i for i, t in enumerate(piece) if t in eos_ids), None)
        generated += piece if eos is None else piece[:eos]
        if eos is not None or len(generated) >= max_new_tokens:
            return ReferenceResult(generated, steps_per_block, forwards)


@torch.inference_mode()
def constrained_greedy(model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int, grammar: Any,
                       eos_ids: Sequence[int]) -> list[int]:
    """Block-size-1 greedy decoding under a grammar (`clover.engine.constraints.grammar`), recomputing the whole
    sequence for every token: the forced tokens first, else the argmax among the allowed ones. Exact mode must give the
    same. `eos_ids` empty (ignore_eos): the model's EOS ends the answer where the grammar can only end."""
    matcher = grammar.matcher(model.config.vocab_size, eos_ids, model.config.eos_token_ids)
    eos_ids = matcher.eos_ids
    prompt, generated = list(prompt), []
    while len(generated) < max_new_tokens:
        forced = matcher.forced()
        if not forced:
            logits = model(torch.tensor([prompt + generated]), block_size=1).logits[0, -1].float()
            logits[model.config.mask_token_id] = float("-inf")
            choice = int(logits.masked_fill(~matcher.allowed(), float("-inf")).argmax())
            matcher.consume([choice])
            forced = [choice]
        if any(t in eos_ids for t in forced):
            forced = forced[: min(i for i, t in enumerate(forced) if t in eos_ids)]
            return (generated + forced)[:max_new_tokens]
        generated += forced
    return generated[:max_new_tokens]
