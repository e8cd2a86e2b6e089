"""Exact mode: drafts verified by the causal path. The output is block-size-1 decoding, token for token.

Each forward reads, per row, the last decided token and `k` drafts causally (written to the cache), then a
query block of `m + 1` masks that drafts the `m` tokens after the one this forward decides:

    forward(clean = [last, d_1 .. d_k], query = m + 1 masks)
    c_0 .. c_k   the causal choice after each clean token
    accept       d_i while d_1..d_i == c_0..c_{i-1}: with `a` accepted the row commits c_0 .. c_a
    rewind       the cache keeps the row's first 1 + a clean tokens (the rejected drafts leave no trace)
    drafts       query output j predicts the token 2 + j positions after the last clean one; usable next
                 forward only where all k drafts were accepted (else they were made after a wrong token)

Every forward commits at least one token, each the model's causal choice given everything before it. With
sampling (temperature, top-k, top-p) the causal path's choice is speculative sampling's (clover.engine.speculative):
draft `d_i` is accepted with the probability the sampler gives it there, a rejection draws from that distribution
without `d_i`, so the output is distributed as sampling one token at a time. `k` and `m`
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
from clover.engine.request import Request, through_eos
from clover.runners.base import RunnerCache
from clover.engine.sampling import BatchSampler, SamplingParams
from clover.engine.speculative import verify

STEP_EMA = 0.2  # weight of the newest step in the running estimate of a step's time, per forward size


@dataclass
class ExactBatch:
    """Exact mode's running batch. Between steps, per row: the tokens the last forward decided (the causal
    path's tokens; emitted at the next step; all but the last already in the cache), the drafts for the next
    forward and the request's acceptance estimate."""

    seqs: list[Request]
    cache: RunnerCache
    sampler: BatchSampler  # the rows' sampling (speculative sampling's target distribution and random streams)
    decided: torch.Tensor  # [N, W]: the first `n_decided` columns count
    n_decided: torch.Tensor  # [N], >= 1
    drafts: torch.Tensor  # [N, D]: the tokens after the last decided one, as the query block predicted them
    n_drafts: torch.Tensor  # [N]: drafts usable next forward (0 where they were made after a rejected token)
    acceptance: list[Acceptance]


class ExactLoop(DecodingLoop):
    """The loop of rule `exact` (module docstring). `cost`: the runner's forward cost, taken as given (a known
    machine, tests); None: measured on first use (`cost_table`) and refined by timing the steps as they run."""

    name = "exact"

    def __init__(self, engine: Any, rule: ExactRule, cost: ForwardCost | None = None) -> None:
        super().__init__(engine)
        self.rule = rule
        self.cost = cost if cost is not None or not rule.adaptive else cost_table(engine.runner)
        self.learns = cost is None  # a given table is the policy's whole cost model
        self.prior = list(getattr(engine.runner.config, "draft_acceptance", None) or []) or None
        self.overhead = 0.0  # seconds per step outside the runner, until a forward of a size has been timed
        self.step_time: dict[int, float] = {}  # measured seconds of a whole step, by the forward's rows
        self.drafted = [0] * engine.block_size  # forwards by the number of drafts their query block made
        # every request's drafts, by position: [accepted, verified]
        self.tally = [[0, 0] for _ in range(engine.block_size - 1)]
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
                "acceptance_by_position": [round(a / n, 4) if n else None for a, n in self.tally],
                "forward_cost": self.cost.summary() if self.cost is not None else None}

    def check(self, params: list[SamplingParams]) -> None:
        for i, p in enumerate(params):
            if p.repetition_penalty != 1.0:
                raise ValueError(
                    f"rule 'exact' cannot apply a repetition penalty (a draft's penalty would depend on whether "
                    f"the drafts before it are accepted): request {i} has repetition_penalty="
                    f"{p.repetition_penalty}; use repetition_penalty=1 or another rule")

    # -- batches ---------------------------------------------------------------------------------------
    def at_boundary(self, b: ExactBatch) -> bool:
        return True  # every step ends what it decided

    def join(self, b: ExactBatch, new: ExactBatch) -> ExactBatch:
        width = max(b.decided.shape[1], new.decided.shape[1])
        drafts = max(b.drafts.shape[1], new.drafts.shape[1])
        return ExactBatch(b.seqs + new.seqs, type(b.cache).concat([b.cache, new.cache]),
                          BatchSampler.concat([b.sampler, new.sampler]),
                          torch.cat([_pad(b.decided, width), _pad(new.decided, width)]),
                          torch.cat([b.n_decided, new.n_decided]),
                          torch.cat([_pad(b.drafts, drafts), _pad(new.drafts, drafts)]),
                          torch.cat([b.n_drafts, new.n_drafts]), b.acceptance + new.acceptance)

    def keep_rows(self, b: ExactBatch, keep: list[int]) -> None:
        idx = torch.tensor(keep, dtype=torch.long, device=self.engine.device)
        b.seqs = [b.seqs[r] for r in keep]
        b.cache.select(idx)
        b.sampler.select(keep)
        b.decided, b.n_decided = b.decided[idx], b.n_decided[idx]
        b.drafts, b.n_drafts = b.drafts[idx], b.n_drafts[idx]
        b.acceptance = [b.acceptance[r] for r in keep]

    # -- the loop --------------------------------------------------------------------------------------
    def open(self, seqs: list[Request], ids: torch.Tensor, cache: RunnerCache, **kwargs: Any) -> ExactBatch:
        """The prefill's last chunk: it decides the first token (from the last prompt token) and drafts after it."""
        n, t = ids.shape
        e = self.engine
        sampler = BatchSampler([s.params for s in seqs], e.vocab_size, e.banned_ids, e.device)
        acceptance = [Acceptance(e.block_size - 1, self.prior) for _ in seqs]
        none = torch.zeros(n, dtype=torch.long, device=e.device)
        m = self._plan(seqs, acceptance, none, cache.length + t)[1]
        ones = torch.ones(n, dtype=torch.long, device=e.device)
        decided, _, drafts = self._forward(ids, cache, sampler, acceptance, none, int(m.max()), **kwargs)
        return ExactBatch(seqs, cache, sampler, decided, ones, drafts, ones * drafts.shape[1], acceptance)

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
        if width > 1:  # drafts to verify: the cache must be able to forget the rejected ones
            b.cache.mark()
        tokens, accepted, drafts = self._forward(ids, b.cache, b.sampler, b.acceptance, k, int(m.max()),
                                                 prefix_len=width,
                                                 attention_mask=None if bool(real.all()) else real)
        if width > 1:
            b.cache.rewind(1 + accepted)
        for acc, verified, took in zip(b.acceptance, k.tolist(), accepted.tolist()):
            acc.tick()
            acc.observe(verified, took)
            for i in range(min(took + 1, verified)):  # positions reached: accepted up to `took`, then one rejected
                self.tally[i][0] += i < took
                self.tally[i][1] += 1
        b.decided, b.n_decided = tokens, 1 + accepted
        b.drafts = drafts
        b.n_drafts = torch.where(accepted == k, drafts.shape[1], 0)
        self._timed(len(b.seqs) * (width + (int(m.max()) + 1 if int(m.max()) else 0)), start,
                    e.counters.forward_time_s - forward_time)
        return events, b

    def _timed(self, rows: int, start: float, forward: float) -> None:
        """What a step of a forward of `rows` rows took, whole (the runner's forward, undoing rejected drafts,
        the engine's own work): the policy's cost of that size from now on (the table gives the rest)."""
        total = time.perf_counter() - start
        self.overhead += STEP_EMA * (total - forward - self.overhead)
        before = self.step_time.get(rows, total)
        self.step_time[rows] = before + STEP_EMA * (total - before)

    def _step_cost(self, rows: int, context: int) -> float:
        """Seconds a step of `rows` rows costs: as timed, or the table's forward plus the engine's time."""
        timed = self.step_time.get(rows) if self.learns else None
        return timed if timed is not None else self.cost(rows, context) + self.overhead

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
                cost = lambda rows: self._step_cost(n * rows, context) / n  # noqa: E731
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
        return through_eos(drafts, e.eos, k)

    def _forward(self, ids: torch.Tensor, cache: RunnerCache, sampler: BatchSampler, acceptance: list[Acceptance],
                 k: torch.Tensor, drafts: int, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward `ids` `[N, T]` as causal clean tokens (written to the cache) whose last `1 + k` per row are
        the last decided token and `k` drafts (the rest padding, or the prompt), and, when `drafts > 0`, a query
        block of `drafts + 1` masks. Returns the committed tokens `[N, 1 + max k]` (-1 after each row's), the
        drafts accepted `[N]` and `[N, drafts]` new drafts: query output `j` predicts the token two positions after
        the last clean one plus `j` (the mask at query position 0 stands for the token this forward decides)."""
        e = self.engine
        n, t = ids.shape
        self.drafted[drafts] += 1
        width = 1 + int(k.max()) if k.numel() else 1
        query = drafts + 1 if drafts else 0
        # logits at the last `width` clean positions (the row's own ones) and the query outputs that draft
        at = torch.zeros(n, t + query, dtype=torch.bool, device=e.device)
        at[:, t - width:t] = self._positions[None, :width] <= k[:, None]
        at[:, t:t + drafts] = True
        out = e.forward(ids, cache, block_size=max(query, 1), query_ids=e.masks(n, query) if query else None,
                        logits_at=at, **kwargs)
        logits = out.new_zeros(n, width + drafts, out.shape[-1])
        logits[at[:, t - width:t + drafts]] = out
        confidence = logits[:, :width].float().softmax(-1).amax(-1) if self.rule.adaptive else None
        accepted, tokens = verify(sampler, logits[:, :width], ids[:, t - width + 1:], k)
        if confidence is not None:  # the causal path's probability of each token it committed
            for acc, row, took in zip(acceptance, confidence.tolist(), accepted.tolist()):
                acc.observe_confidence(row[: took + 1])
        return tokens, accepted, self._greedy(logits[:, width:])

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafter's choice: argmax over the ids that may be emitted (drafts are point masses)."""
        x = logits.float()
        x[..., self.engine.banned_ids] = float("-inf")
        return x.max(dim=-1).indices


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` `[N, w]` right-padded with -1 to `width` columns (or unchanged when already as wide)."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) if t.shape[1] < width else t
