"""`BlockLayout`: the block structure of one forward pass, and the attention mask it implies.

A forward pass sees two streams of new tokens after whatever the cache holds:

* **clean** tokens, committed context: a causal prefix (`prefix_len` tokens, each its own block: a prompt is
  read exactly as the AR base reads it) followed by blocks of `block_size` tokens, bidirectional inside a block
  and causal between blocks. With a cache, clean tokens are written to it.
* **query** tokens: `query_blocks` blocks of `block_size` (masked or partly decoded blocks, or training's noised
  copies). Query block `j` starts at clean offset `query_start + j * block_size`: it sees the cache, the clean
  tokens before its start, and itself in both directions. Query tokens are never written to the cache.

This one description covers the AR forward (`block_size=1`), prefill + first denoising step, a denoising step
(no clean tokens), commit + next block in one pass, and BD3-LM's vectorised training layout.

`causal_clean` (a model whose `context_reading` is "causal"): every clean token is read causally, as the AR base
reads it, whatever the block grid; `prefix_len` and `block_size` then only place the query blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockLayout:
    clean_len: int
    block_size: int = 1
    prefix_len: int = 0
    query_blocks: int = 0
    query_start: int = 0
    causal_clean: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not 0 <= self.prefix_len <= self.clean_len:
            raise ValueError(f"prefix_len must be in [0, {self.clean_len}], got {self.prefix_len}")
        if self.block_size == 1:  # blocks of one token are causal: the whole clean stream is a causal prefix
            object.__setattr__(self, "prefix_len", self.clean_len)
        if self.query_blocks:
            last = self.query_start + (self.query_blocks - 1) * self.block_size
            on_grid = self.query_start == self.clean_len or (
                self.query_start >= self.prefix_len and (self.query_start - self.prefix_len) % self.block_size == 0)
            if not on_grid or last > self.clean_len:
                raise ValueError(f"query blocks must start on clean block boundaries inside the clean stream "
                                 f"(query_start={self.query_start}, blocks={self.query_blocks}, layout={self})")

    @property
    def query_len(self) -> int:
        return self.query_blocks * self.block_size

    @property
    def causal_len(self) -> int:
        """Clean tokens read causally (each its own block): the prefix, or all of them with `causal_clean`."""
        return self.clean_len if self.causal_clean else self.prefix_len

    @property
    def blocked_len(self) -> int:
        return self.clean_len - self.causal_len

    @property
    def num_clean_blocks(self) -> int:
        return math.ceil(self.blocked_len / self.block_size)

    def clean_block_ids(self, device: torch.device | None = None) -> torch.Tensor:
        idx = torch.arange(self.clean_len, device=device)
        c = self.causal_len
        return torch.where(idx < c, idx, c + torch.div(idx - c, self.block_size, rounding_mode="floor"))

    def query_block_starts(self, device: torch.device | None = None) -> torch.Tensor:
        """Clean offset at which each query token's block starts, `[query_len]`."""
        block = torch.div(torch.arange(self.query_len, device=device), self.block_size, rounding_mode="floor")
        return self.query_start + block * self.block_size

    def attention_mask(self, past_valid: torch.Tensor | None, clean_valid: torch.Tensor | None,
                       batch: int, device: torch.device) -> tuple[torch.Tensor | None, bool]:
        """Boolean mask `[N, 1, clean+query, past+clean+query]` (True = may attend), or `(None, is_causal)`.

        `past_valid` `[N, past]` / `clean_valid` `[N, clean]` mark real tokens (False = left padding). A padded
        query row still sees its own key, so no softmax row is empty.
        """
        past = 0 if past_valid is None else past_valid.shape[1]
        lc, lq = self.clean_len, self.query_len
        padded = (past_valid is not None and not bool(past_valid.all())) or (
            clean_valid is not None and not bool(clean_valid.all()))
        causal_only = lq == 0 and self.causal_len == lc
        if not padded and causal_only and (past == 0 or lc == 1):
            return None, past == 0 and lc > 1
        one_block = (lq == 0 and self.causal_len == 0 and self.num_clean_blocks == 1) or (
            lc == 0 and self.query_blocks == 1)
        if not padded and one_block:
            return None, False  # a single block against the cache: every key is visible
        bid = self.clean_block_ids(device)
        rows = []
        clean_clean = bid[None, :] <= bid[:, None]
        rows.append(torch.cat([clean_clean, torch.zeros(lc, lq, dtype=torch.bool, device=device)], dim=1))
        if lq:
            starts = self.query_block_starts(device)
            query_clean = torch.arange(lc, device=device)[None, :] < starts[:, None]
            query_query = starts[:, None] == starts[None, :]
            rows.append(torch.cat([query_clean, query_query], dim=1))
        structure = torch.cat(rows, dim=0)  # [lc+lq, lc+lq]
        structure = torch.cat([torch.ones(lc + lq, past, dtype=torch.bool, device=device), structure], dim=1)
        mask = structure[None].expand(batch, -1, -1)
        if padded:
            key_valid = torch.cat([
                past_valid if past_valid is not None else torch.ones(batch, 0, dtype=torch.bool, device=device),
                clean_valid if clean_valid is not None else torch.ones(batch, lc, dtype=torch.bool, device=device),
                torch.ones(batch, lq, dtype=torch.bool, device=device)], dim=1)
            own = torch.zeros(lc + lq, past + lc + lq, dtype=torch.bool, device=device)
            own[:, past:].fill_diagonal_(True)
            mask = (mask & key_valid[:, None, :]) | own[None]
        return mask[:, None], False
