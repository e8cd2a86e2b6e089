"""Exact mode: the engine's loop for a rule that `verifies` (`exact`), whose output is block-size-1 greedy
decoding token for token, at fewer forwards.

Each forward reads the last decided token and its drafts causally, commits the drafts the causal greedy path
agrees with plus that path's next token, rewinds the cache over the rest (the cache's `mark` / `rewind`) and
drafts the next ones from a query block of masks (docs/decoding.md, "Exact mode"). It is a mixin of `Engine`
(prefill, batching, `join` / `drop` and emission are the engine's; only the step differs), kept apart so the
block loop in `engine.py` reads on its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from clover.engine.request import Request
from clover.engine.runner import RunnerCache

if TYPE_CHECKING:
    from clover.engine.engine import Engine, Event


@dataclass
class ExactBatch:
    """Exact mode's running batch. Between steps, per row: the tokens the last forward decided (the causal
    greedy tokens; emitted at the next step; all but the last already in the cache) and the drafts for the next
    forward (from that forward's query block; usable only where it accepted every draft it verified)."""

    seqs: list[Request]
    cache: RunnerCache
    decided: torch.Tensor  # [N, B]: the first `n_decided` columns count
    n_decided: torch.Tensor  # [N], >= 1
    drafts: torch.Tensor  # [N, B - 1]: the tokens after the last decided one, as the query block predicted them
    n_drafts: torch.Tensor  # [N]: B - 1, or 0 where the drafts were made after a rejected token


class ExactMode:
    """`Engine`'s exact-mode steps (mixed into `Engine`; `self` is the engine)."""

    def _greedy(self: Engine, logits: torch.Tensor) -> torch.Tensor:
        """The greedy choice `BatchSampler` makes for a greedy request without repetition penalty: argmax over
        the ids that may be emitted."""
        x = logits.float()
        x[..., self._banned_ids] = float("-inf")
        return x.max(dim=-1).indices

    def _exact_forward(self: Engine, ids: torch.Tensor, cache: RunnerCache, want: torch.Tensor,
                       **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward `ids` `[N, T]` as causal clean tokens (written to the cache), with a query block of `B` masks
        after each row's last real one. Returns the causal greedy choice after each clean position where `want`
        `[N, T]` (-1 elsewhere) and `[N, B - 1]` drafts: query output `j` predicts the token two positions after
        the last clean one plus `j` (the mask at query position 0 stands for the token the clean logits decide)."""
        n, t = ids.shape
        drafting = self.block_size > 1
        at = torch.cat([want, self._positions[None].expand(n, -1) < self.block_size - 1], dim=1) if drafting else want
        out = self._forward(ids, cache, query_ids=self._masks(n) if drafting else None, logits_at=at, **kwargs)
        tokens = torch.full(at.shape, -1, dtype=torch.long, device=self.device)
        tokens[at] = self._greedy(out)
        return tokens[:, :t], tokens[:, t:t + self.block_size - 1]

    def _exact_open(self: Engine, seqs: list[Request], ids: torch.Tensor, cache: RunnerCache,
                    **kwargs: Any) -> ExactBatch:
        """The prefill's last chunk in exact mode: it decides the first token (from the last prompt token) and
        drafts the `B - 1` after it."""
        n, t = ids.shape
        want = torch.zeros(n, t, dtype=torch.bool, device=self.device)
        want[:, -1] = True
        tokens, drafts = self._exact_forward(ids, cache, want, **kwargs)
        decided = torch.nn.functional.pad(tokens[:, -1:], (0, self.block_size - 1), value=-1)
        ones = torch.ones(n, dtype=torch.long, device=self.device)
        return ExactBatch(seqs, cache, decided, ones, drafts, ones * (self.block_size - 1))

    def _exact_step(self: Engine, b: ExactBatch) -> tuple[list[Event], ExactBatch | None]:
        """Emit what the last forward decided; then one forward verifies the drafts and drafts anew.

        The forward's clean tokens are, per row, the last decided token (not yet in the cache) and the drafts
        `d_1..d_k`, read causally and right-padded to the batch's widest row. The causal choice after clean
        column `i` is `c_i`; draft `d_i` is accepted while `d_1..d_i == c_0..c_{i-1}`, so with `a` drafts
        accepted the row decides `c_0..c_a` (the drafts it confirmed plus the causal token at the first
        difference, or the bonus token after the last draft): at least one token per forward, each the model's
        causal greedy token given everything before it, i.e. block-size-1 greedy decoding. The cache then
        forgets the rejected drafts (the cache's `rewind` keeps each row's first `1 + a` clean tokens). The
        query block's drafts were made after the last draft, so they are used only where all drafts were
        accepted; elsewhere the next forward verifies nothing and drafts anew."""
        now = time.perf_counter()
        decided, counts = b.decided.tolist(), b.n_decided.tolist()
        events: list[Event] = []
        keep = []
        for r, seq in enumerate(b.seqs):  # one step, fed by one forward
            events.append(self._emit(seq, decided[r][: min(counts[r], seq.remaining)], 1, 1, now))
            if not seq.finished:
                keep.append(r)
        self.counters.steps += 1
        if not keep:
            return events, None
        if len(keep) < len(b.seqs):
            self._keep_rows(b, keep)

        # drafts worth verifying: none past the row's last token (the decided token adds one), none after an EOS
        remaining = torch.tensor([s.remaining for s in b.seqs], dtype=torch.long, device=self.device)
        k = torch.minimum(b.n_drafts, remaining - 1)
        if self.eos_ids and b.drafts.shape[1]:
            eos = torch.isin(b.drafts, self._eos)
            k = torch.where(eos.any(1), torch.minimum(k, eos.int().argmax(1) + 1), k)
        width = 1 + int(k.max())
        last = b.decided.gather(1, (b.n_decided - 1)[:, None])
        real = self._positions[None, :width] < (1 + k)[:, None]  # [N, width]: the row's tokens, then padding
        ids = torch.cat([last, b.drafts[:, : width - 1]], dim=1).masked_fill(~real, self.mask_id)
        b.cache.mark()
        tokens, b.drafts = self._exact_forward(ids, b.cache, real, prefix_len=width,
                                               attention_mask=None if bool(real.all()) else real)
        agree = (ids[:, 1:] == tokens[:, :-1]) & real[:, 1:]
        accepted = agree.int().cumprod(dim=1).sum(dim=1)
        b.cache.rewind(1 + accepted)
        b.decided = torch.nn.functional.pad(tokens, (0, self.block_size - width), value=-1)
        b.n_decided = 1 + accepted
        b.n_drafts = torch.where(accepted == k, self.block_size - 1, 0)
        return events, b
