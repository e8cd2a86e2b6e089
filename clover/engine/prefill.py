"""The prompt prefill that generation (engine.py) and decision mode (decision.py) share.

A batch's prompts are **left-padded** to the longest: right-aligned, so every row's last prompt token sits in the
last column and the first query block follows it in every row at the same offset. Padded columns are marked
invalid (`attention_mask` 0): attention skips them and a DeltaNet layer neither reads nor writes there, so each
row computes what it computes alone (docs/architecture.md).

The padded prompts are read causally in chunks of `chunk` tokens (bounding the activation memory of long
prompts); every chunk but the last is written to the cache without logits. Every forward that reads prompt tokens,
the caller's first one too, is asked of the runner with `prompt=True` (clover.engine.runner: one path through a
quantised layer for prompt rows, whatever shares their forward). With a block `grid` (a model whose `prompt_reading`
is "blocks") the prompts are read on that grid instead: left-padded further to whole blocks, so the grid ends where
every prompt ends (padding is invalid, so each row still reads what it reads alone: its first block holds its first
`len % grid` tokens), each block read in both directions and chunks cut on block boundaries. The last chunk is
returned to the caller, whose first forward carries it with its first query block (the prefill's last forward is
decoding's first step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

DEFAULT_PREFILL_CHUNK = 2048  # prompt tokens per prefill forward
# answer tokens a request's KV is first allocated for beside its prompt (`CloverCache.expect`); a longer answer
# grows it by quarters. Bounded: a request allowed the whole context must not reserve it all.
EXPECTED_ANSWER = 512

# forward(clean ids [N, T], **kwargs) for one prefill chunk: kwargs are `prefix_len`, `attention_mask`,
# `logits_to_keep=0` (the runner's `forward` with the cache and block size bound by the caller)
ChunkForward = Callable[..., Any]


@dataclass
class LastChunk:
    """The prompt's last chunk, left to the caller's first forward."""

    ids: torch.Tensor  # [N, T] clean tokens, left-padded
    attention_mask: torch.Tensor | None  # [N, T]: False at padding; None when no row is padded
    forwards: int  # forwards the prefill takes, this last one included
    grid: int = 1  # the block grid the prompt is read on (1: causally)

    @property
    def kwargs(self) -> dict[str, Any]:
        """The runner `forward` arguments that read this chunk as the prefill reads it (causally, or as blocks of
        the grid: a causal prefix of none)."""
        return {"prefix_len": self.ids.shape[1] if self.grid == 1 else 0, "attention_mask": self.attention_mask}


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device,
             grid: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[N, W]` ids with each prompt right-aligned (`pad_id` before it) and the `[N, W]` mask of real tokens, `W`
    the longest length rounded up to a multiple of `grid`; the mask is None when no row is padded. On a block grid
    a prompt may be empty (an absolute grid whose prompt fits in the first generated block:
    clover.engine.loops.block_loop); its row is all padding."""
    if not prompts or (grid == 1 and any(len(p) == 0 for p in prompts)):
        raise ValueError("left_pad needs at least one prompt, each of at least one token")
    longest = -(-max(len(p) for p in prompts) // grid) * grid
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), longest, dtype=torch.bool)
    for r, p in enumerate(prompts):
        ids[r, longest - len(p):] = torch.tensor(list(p), dtype=torch.long)
        valid[r, longest - len(p):] = True
    return ids.to(device), None if bool(valid.all()) else valid.to(device)


def grid_chunk(chunk: int, grid: int) -> int:
    """The prefill chunk on a block grid: whole blocks (at least one), so no block is cut between forwards."""
    if chunk < 1:
        raise ValueError(f"the prefill chunk must be >= 1, got {chunk}")
    return max(grid, chunk // grid * grid)


def prefill(prompts: Sequence[Sequence[int]], pad_id: int, chunk: int, forward: ChunkForward,
            device: torch.device, grid: int = 1) -> LastChunk:
    """Left-pad `prompts` (to whole blocks of `grid`), write every chunk of `chunk` tokens but the last through
    `forward` (no logits), and return the last chunk."""
    chunk = grid_chunk(chunk, grid)
    ids, valid = left_pad(prompts, pad_id, device, grid)
    if ids.shape[1] == 0:  # every prompt opens its first block whole: nothing to prefill
        return LastChunk(ids, None, 1, grid)  # (the caller's first forward, which carries the first block)
    starts = range(0, ids.shape[1], chunk)
    for start in starts[:-1]:
        end = start + chunk
        forward(ids[:, start:end], prefix_len=end - start if grid == 1 else 0,
                attention_mask=None if valid is None else valid[:, start:end], logits_to_keep=0, prompt=True)
    last = starts[-1]
    return LastChunk(ids[:, last:], None if valid is None else valid[:, last:], len(starts), grid)
