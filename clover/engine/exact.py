"""Exact mode: drafts verified by the causal path. The output is block-size-1 decoding, token for token.

Each forward reads, per row, the last decided token and `k` drafts causally (written to the cache), then a
query block of `m + 1` masks that drafts the `m` tokens after the one this forward decides:

    forward(clean = [last, d_1 .. d_k], query = m + 1 masks)
    c_0 .. c_k   the causal choice after each clean token
    accept       d_i while d_1..d_i == c_0..c_{i-1}: with `a` accepted the row commits c_0 .. c_a
    rewind       the cache keeps the row's first 1 + a clean tokens (the rejected drafts leave no trace)
    drafts       query output j predicts the token 2 + j positions after the last clean one; usable next
                 forward only where all k drafts were accepted (else they were made after a wrong token)

Every forward commits at least one token, each the model's causal choice given everything before it. `k` and `m`
change nothing in the output, only in the cost: `clover.engine.drafting` picks them per step and row from the
runner's measured cost (`clover.engine.cost`) and the request's acceptance so far (`adaptive`, the default), or
always the whole block (`adaptive=False`: `m = B - 1`, every draft verified). `m = 0` is a one-row forward with
no query block: block size 1 itself.

In floating point, verifying `k + 1` tokens in one forward and feeding them one at a time are different sums
(~1e-5 apart in fp32), so a near-tie between the two best tokens can flip; exact mode is block size 1 in exact
arithmetic, and token for token wherever the model's choice is not a near-tie (docs/decoding.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from clover.engine.cost import ForwardCost, cost_table
from clover.engine.decoding import ExactRule
from clover.engine.drafting import Acceptance, best_drafts
from clover.engine.loop import DecodingLoop, Event
from clover.engine.request import Request
from clover.engine.runner import RunnerCache
from clover.engine.sampling import SamplingParams

OVERHEAD_EMA = 0.1  # weight of the newest step in the running estimate of the engine's own time per step


@dataclass
class ExactBatch:
    """Exact mode's running batch. Between steps, per row: the tokens the last forward decided (the causal
    greedy tokens; emitted at the next step; all but the last already in the cache), the drafts for the next
    forward and the request's acceptance estimate."""

    seqs: list[Request]
    cache: RunnerCache
    decided: torch.Tensor  # [N, W]: the first `n_decided` columns count
    n_decided: torch.Tensor  # [N], >= 1
    drafts: torch.Tensor  # [N, D]: the tokens after the last decided one, as the query block predicted them
    n_drafts: torch.Tensor  # [N]: drafts usable next forward (0 where they were made after a rejected token)
    acceptance: list[Acceptance]


class ExactLoop(DecodingLoop):
    """The loop of rule `exact` (module docstring). `cost`: the runner's forward cost (measured on first use
    when None and the rule is adaptive)."""

    name = "exact"

    def __init__(self, engine: Any, rule: ExactRule, cost: ForwardCost | None = None) -> None:
        super().__init__(engine)
        self.rule = rule
        self.cost = cost if cost is not None or not rule.adaptive else cost_table(engine.runner)
        self.prior = list(getattr(engine.runner.config, "draft_acceptance", None) or []) or None
        self.overhead = 0.0  # seconds per step outside the runner: the same for every choice of k and m
        self.drafted = [0] * engine.block_size  # forwards by the number of drafts their query block made
        self._positions = torch.arange(engine.block_size, device=engine.device)

    @staticmethod
    def room(context: int, prompt_len: int, block_size: int) -> tuple[int, str]:
        # the last forward still carries a query block after at most B - 1 drafts
        return context - prompt_len - (block_size - 1), f"{block_size - 1} positions for drafting"

    def figures(self) -> dict[str, Any]:
        total = sum(self.drafted)
        return {"adaptive": self.rule.adaptive,
                "drafts_per_forward": round(sum(m * n for m, n in enumerate(self.drafted)) / total, 3) if total else 0,
                "forwards_by_drafts": list(self.drafted),
                "forward_cost": self.cost.summary() if self.cost is not None else None}

    def check(self, params: list[SamplingParams]) -> None:
        for i, p in enumerate(params):
            if not p.greedy or p.repetition_penalty != 1.0:
                raise ValueError(
                    f"rule 'exact' is greedy decoding (its output is the model's own greedy output): request {i} "
                    f"has temperature={p.temperature}, repetition_penalty={p.repetition_penalty}; use "
                    "temperature=0 and repetition_penalty=1, or another rule")

    # -- batches ---------------------------------------------------------------------------------------
    def at_boundary(self, b: ExactBatch) -> bool:
        return True  # every step ends what it decided

    def join(self, b: ExactBatch, new: ExactBatch) -> ExactBatch:
        width = max(b.decided.shape[1], new.decided.shape[1])
        drafts = max(b.drafts.shape[1], new.drafts.shape[1])
        return ExactBatch(b.seqs + new.seqs, type(b.cache).concat([b.cache, new.cache]),
                          torch.cat([_pad(b.decided, width), _pad(new.decided, width)]),
                          torch.cat([b.n_decided, new.n_decided]),
                          torch.cat([_pad(b.drafts, drafts), _pad(new.drafts, drafts)]),
                          torch.cat([b.n_drafts, new.n_drafts]), b.acceptance + new.acceptance)

    def keep_rows(self, b: ExactBatch, keep: list[int]) -> None:
        idx = torch.tensor(keep, dtype=torch.long, device=self.engine.device)
        b.seqs = [b.seqs[r] for r in keep]
        b.cache.select(idx)
        b.decided, b.n_decided = b.decided[idx], b.n_decided[idx]
        b.drafts, b.n_drafts = b.drafts[idx], b.n_drafts[idx]
        b.acceptance = [b.acceptance[r] for r in keep]

    # -- the loop --------------------------------------------------------------------------------------
    def open(self, seqs: list[Request], ids: torch.Tensor, cache: RunnerCache, **kwargs: Any) -> ExactBatch:
        """The prefill's last chunk: it decides the first token (from the last prompt token) and drafts after it."""
        n, t = ids.shape
        e = self.engine
        acceptance = [Acceptance(e.block_size - 1, self.prior) for _ in seqs]
        none = torch.zeros(n, dtype=torch.long, device=e.device)
        m = self._plan(seqs, acceptance, none, cache.length + t)[1]
        want = torch.zeros(n, t, dtype=torch.bool, device=e.device)
        want[:, -1] = True
        tokens, drafts = self._forward(ids, cache, want, int(m.max()), **kwargs)
        ones = torch.ones(n, dtype=torch.long, device=e.device)
        return ExactBatch(seqs, cache, tokens[:, -1:], ones, drafts, ones * drafts.shape[1], acceptance)

    def step(self, b: ExactBatch, snapshots: bool = False) -> tuple[list[Event], ExactBatch | None]:
        """Emit what the last forward decided; then one forward verifies drafts and drafts anew."""
        e = self.engine
        start, forward_time = time.perf_counter(), e.counters.forward_time_s
        decided, counts = b.decided.tolist(), b.n_decided.tolist()
        events = e.emit(b, [(decided[r][: min(counts[r], s.remaining)], 1, 1) for r, s in enumerate(b.seqs)])
        e.counters.steps += 1
        if not b.seqs:
            return events, None

        k, m = self._plan(b.seqs, b.acceptance, b.n_drafts, b.cache.length + 1 + b.drafts.shape[1])
        k = self._before_eos(b.drafts, k)
        width = 1 + int(k.max())
        last = b.decided.gather(1, (b.n_decided - 1)[:, None])
        real = self._positions[None, :width] < (1 + k)[:, None]  # [N, width]: the row's tokens, then padding
        ids = torch.cat([last, _pad(b.drafts, width - 1)[:, : width - 1]], dim=1).masked_fill(~real, e.mask_id)
        b.cache.mark()
        tokens, drafts = self._forward(ids, b.cache, real, int(m.max()), prefix_len=width,
                                       attention_mask=None if bool(real.all()) else real)
        agree = (ids[:, 1:] == tokens[:, :-1]) & real[:, 1:]
        accepted = agree.int().cumprod(dim=1).sum(dim=1)
        b.cache.rewind(1 + accepted)
        for acc, verified, took in zip(b.acceptance, k.tolist(), accepted.tolist()):
            acc.observe(verified, took)
        b.decided, b.n_decided = tokens, 1 + accepted
        b.drafts = drafts
        b.n_drafts = torch.where(accepted == k, drafts.shape[1], 0)
        spent = time.perf_counter() - start - (e.counters.forward_time_s - forward_time)
        self.overhead += OVERHEAD_EMA * (spent - self.overhead)
        return events, b

    def _plan(self, seqs: list[Request], acceptance: list[Acceptance], available: torch.Tensor,
              context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: `k` drafts to verify (of those available) and `m` to draft next. None past the request's
        last token: the decided token is one, the drafts verified next time need one more each."""
        e = self.engine
        most = e.block_size - 1
        remaining = [s.remaining for s in seqs]
        avail = available.tolist()
        ks, ms = [], []
        for r, acc in enumerate(acceptance):
            if self.rule.adaptive:
                n = len(seqs)  # rows share a forward: each row pays its share of the batch's rows
                cost = lambda rows: (self.cost(n * rows, context) + self.overhead) / n  # noqa: E731
                want = best_drafts(acc.optimistic(), cost, most)
            else:
                want = most
            k = min(avail[r], want, max(remaining[r] - 1, 0))
            ks.append(k)
            ms.append(min(want, max(remaining[r] - k - 2, 0)))
        device = e.device
        return torch.tensor(ks, dtype=torch.long, device=device), torch.tensor(ms, dtype=torch.long, device=device)

    def _before_eos(self, drafts: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """No draft after a drafted EOS is worth verifying (what follows an EOS is dropped)."""
        e = self.engine
        if not e.eos_ids or not drafts.shape[1]:
            return k
        eos = torch.isin(drafts, e.eos)
        return torch.where(eos.any(1), torch.minimum(k, eos.int().argmax(1) + 1), k)

    def _forward(self, ids: torch.Tensor, cache: RunnerCache, want: torch.Tensor, drafts: int,
                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward `ids` `[N, T]` as causal clean tokens (written to the cache) and, when `drafts > 0`, a query
        block of `drafts + 1` masks after each row's last real one. Returns the causal greedy choice after each
        clean position where `want` `[N, T]` (-1 elsewhere) and `[N, drafts]` drafts: query output `j`
        predicts the token two positions after the last clean one plus `j` (the mask at query position 0 stands
        for the token the clean logits decide)."""
        e = self.engine
        n, t = ids.shape
        self.drafted[drafts] += 1
        query = drafts + 1 if drafts else 0
        at = torch.cat([want, self._positions[None, :query].expand(n, -1) < drafts], dim=1) if query else want
        out = e.forward(ids, cache, block_size=max(query, 1), query_ids=e.masks(n, query) if query else None,
                        logits_at=at, **kwargs)
        tokens = torch.full(at.shape, -1, dtype=torch.long, device=e.device)
        tokens[at] = self._greedy(out)
        return tokens[:, :t], tokens[:, t:t + drafts]

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy choice `BatchSampler` makes for a greedy request without repetition penalty: argmax over
        the ids that may be emitted."""
        x = logits.float()
        x[..., self.engine.banned_ids] = float("-inf")
        return x.max(dim=-1).indices


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` `[N, w]` right-padded with -1 to `width` columns (or unchanged when already as wide)."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) if t.shape[1] < width else t
