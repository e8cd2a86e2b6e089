"""Block diffusion: a block of masks is denoised in steps chosen by an unmasking rule, then committed.

One request, block size `B` (docs/decoding.md has the full semantics):

    open      forward(prompt as causal clean tokens, query = B masks)      -> logits for step 1 of block 1
    step      fill positions chosen by the unmasking rule
              block not done: forward(query = current block)               -> logits for the next step
              block done:     emit it; forward(clean = block, query = B masks) -> commit + step 1 of the next block

The prediction for block position `p` is the output one position to its left (token shift): for `p = 0` the
clean logits of the last committed token, for `p >= 1` query output `p - 1`. So every step consumes exactly one
forward, and a block decided in one step costs one forward. With `B = 1` no query block is needed at all and the
loop is exactly AR decoding. A model without the shift (`token_shift` false: SDAR, dllm's BD3LM) predicts
position `p` from query output `p` itself; every position then needs the query block, `B = 1` included (one mask
read against the context). A model whose `prompt_reading` is "blocks" reads the prompt on the block grid
(`prompt_grid`; clover.engine.prefill); on an "absolute" `block_grid` the prompt's last `len % B` tokens are not
prefilled but open the first block (its `head`: decided, never emitted), which the first generated tokens complete.
The LM head runs only for positions that can still be filled (`logits_at`): on a small model with a large
vocabulary it is a fifth of a token's compute, and after the first step of a block most positions are decided.
When only position 0 is left, whose prediction does not depend on the block, the step needs no forward at all.

Batches run in lockstep, block by block: every row's block is committed in the same forward, and a row whose
block is already final sits out the remaining steps of the others (its outputs are ignored), so each request gets
exactly what it gets alone. A sampled position draws with noise keyed by the request's seed, its answer position and
the row's own step in the block (clover.engine.noise), so that holds for seeded sampling too; at block size 1 (one
step per block) the draw is exact mode's. A finished request leaves the batch at the next commit.

A request's thinking budget (clover.engine.constraints.thinking) bounds which positions a step may fill
(`_within_budget`) and writes the closing sequence where the budget is spent (`_force_closing`): those positions are
decided without a step, as a block's `head` is, but they are output.

Where things happen: `step` (one denoising step), `_finish_block` (EOS / stop / length, emit), `_commit` (the
block joins the cache).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from clover.engine.decoding import UnmaskingRule
from clover.engine.logprobs import TokenLogprob, token_logprobs
from clover.engine.loops.loop import DecodingLoop, Event, LoopEngine, StepSnapshot
from clover.engine.request import RequestOptions, Sequence, before_eos, through_eos
from clover.engine.runner import RunnerCache
from clover.engine.sampling import BatchSampler


@dataclass
class BlockBatch:
    """The tensors of the requests being block-decoded together (row r is `seqs[r]`)."""

    seqs: list[Sequence]
    cache: RunnerCache
    sampler: BatchSampler
    block: torch.Tensor  # [N, B] current block, mask id where undecided
    logits: torch.Tensor  # [N, B, V] the prediction for each block position (token shift applied); current
    # where the position is still needed, stale or zero elsewhere
    steps: torch.Tensor  # [N] steps each row has taken in this block
    limit: torch.Tensor  # [N] positions of this block that can count: min(B, tokens the row may still produce),
    # or fewer once a stop string is complete in the block's decided prefix
    forwards: torch.Tensor  # [N] forwards that fed this row's steps in this block (a step may need none)
    head: torch.Tensor  # [N] the block's first positions that hold prompt tokens (an "absolute" grid's first block)
    rule: UnmaskingRule  # the rule with each row's threshold (`BlockLoop.rule_for`)
    step_index: int = 0
    needed: torch.Tensor | None = None  # [N, B] `_needed` as the last step left it; None on a fresh block
    # per row asking for logprobs, each block position's (set by the step that unmasks it); None for other rows
    logprobs: list[list[TokenLogprob | None] | None] = field(default_factory=list)


class BlockLoop(DecodingLoop):
    """Block diffusion decoding with an unmasking rule (clover.engine.decoding)."""

    name = "block"

    def __init__(self, engine: LoopEngine, rule: UnmaskingRule) -> None:
        super().__init__(engine)
        self.rule = rule
        self._positions = torch.arange(engine.block_size, device=engine.device)
        config = engine.runner.config
        self.shift = config.token_shift  # position p read from query output p - 1 (True) or p (False)
        self.prompt_grid = engine.block_size if config.prompt_reading == "blocks" else 1
        self.absolute_grid = self.prompt_grid > 1 and config.block_grid == "absolute"

    def _head(self, prompt: list[int]) -> int:
        """Prompt tokens that open the first block: those past the last whole block of an absolute grid."""
        return len(prompt) % self.prompt_grid if self.absolute_grid else 0

    def prefilled(self, prompt: list[int]) -> list[int]:
        return prompt[: len(prompt) - self._head(prompt)]

    def check(self, options: list[RequestOptions]) -> None:
        for i, o in enumerate(options):
            if o.grammar is not None:
                raise ValueError(
                    f"rule {self.rule.name!r} cannot follow a grammar (request {i}): its steps fill a block's "
                    f"positions in any order, and a grammar decides what may come next only left to right; use rule "
                    f"'exact' (its output is constrained block-size-1 decoding)")

    def room(self, context: int, prompt_len: int, block_size: int) -> tuple[int, str]:
        # the last block occupies B positions; on an absolute grid the first block starts up to B - 1 positions
        # before the prompt's end
        early = block_size - 1 if self.absolute_grid else 0
        return max(context - prompt_len - early, 0) // block_size * block_size, f"whole blocks of {block_size}"

    # -- open ------------------------------------------------------------------------------------------
    def open(self, seqs: list[Sequence], ids: torch.Tensor, cache: RunnerCache, **kwargs: Any) -> BlockBatch:
        """The prefill's last chunk carries block 1's masks as a query block: it is also block 1's first step."""
        e = self.engine
        n = len(seqs)
        block = e.masks(n)
        head = torch.tensor([self._head(s.prompt) for s in seqs], dtype=torch.long, device=e.device)
        for r, (s, h) in enumerate(zip(seqs, head.tolist())):
            if h:
                block[r, :h] = torch.tensor(s.prompt[-h:], dtype=torch.long, device=e.device)
        limit = self._limits(seqs, head)
        self._force_closing(seqs, block, head, limit)
        logits = self._open_block(ids if ids.shape[1] else None, block, head, cache, limit, **kwargs)
        sampler = BatchSampler([s.options.sampling for s in seqs], e.vocab_size, e.banned_ids, e.device, e.breakers)
        sampler.observe([s.prompt for s in seqs])
        zeros = torch.zeros(n, dtype=torch.long, device=e.device)
        return BlockBatch(seqs, cache, sampler, block, logits, zeros, limit, zeros + 1, head, self.rule_for(seqs),
                          logprobs=self._no_logprobs(seqs))

    def rule_for(self, seqs: list[Sequence]) -> UnmaskingRule:
        """The engine's rule, or a copy of it whose `threshold` is `[N, 1]`, one per row, when the rows ask for
        different ones: every rule compares confidences `[N, B]` with its threshold by broadcasting, so each row
        is decided exactly as it would be alone (options per request, one batch: as vLLM keeps sampling settings
        per sequence)."""
        if "threshold" not in getattr(self.rule, "__dataclass_fields__", {}):
            return self.rule  # a rule without a threshold (top_k_per_step): the requests' thresholds do not apply
        own = [self.rule.threshold if s.options.threshold is None else s.options.threshold for s in seqs]
        if all(t == self.rule.threshold for t in own):
            return self.rule
        rule = copy.copy(self.rule)  # not `dataclasses.replace`: its check takes one float
        rule.threshold = torch.tensor(own, dtype=torch.float32, device=self.engine.device)[:, None]
        return rule

    def _open_block(self, ids: torch.Tensor | None, block: torch.Tensor, head: torch.Tensor, cache: RunnerCache,
                    limit: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Forward clean `ids` `[N, T]` (None: nothing to commit) with the fresh `block` (masks after each row's
        `head`) as the query: `[N, B, V]` predictions for the block's positions (with the shift: 0 from the last
        clean token, `p >= 1` from query output `p - 1`; without: `p` from query output `p`), computed only from
        each row's `head` and before its `limit` (zeros elsewhere)."""
        e = self.engine
        n, b = block.shape
        t = 0 if ids is None else ids.shape[1]
        wanted = (self._positions[None] < limit[:, None]) & (self._positions[None] >= head[:, None])  # [N, B]
        query = b > 1 or not self.shift
        at = torch.zeros(n, t + (b if query else 0), dtype=torch.bool, device=e.device)
        if self.shift:
            if t:
                at[:, t - 1] = wanted[:, 0]
            at[:, t:t + b - 1] = wanted[:, 1:]
        else:
            at[:, t:] = wanted
        out = e.forward(ids, cache, query_ids=block if query else None, logits_at=at, **kwargs)
        if bool(wanted.all()):  # every position counts (block size 1's every step): `out` is already [N * B, V]
            return out.view(n, b, out.shape[-1])
        logits = out.new_zeros(n, b, out.shape[-1])
        logits[wanted] = out
        return logits

    def _limits(self, seqs: list[Sequence], head: torch.Tensor | None = None) -> torch.Tensor:
        """Positions of the block that can count: its `head` and the tokens each row may still produce."""
        remaining = torch.tensor([s.remaining for s in seqs], dtype=torch.long, device=self.engine.device)
        return (remaining if head is None else remaining + head).clamp(max=self.engine.block_size)

    # -- batches ---------------------------------------------------------------------------------------
    def at_boundary(self, b: BlockBatch) -> bool:
        """No step of the current block taken yet."""
        return b.step_index == 0

    def join(self, b: BlockBatch, new: BlockBatch) -> BlockBatch:
        return BlockBatch(b.seqs + new.seqs, type(b.cache).concat([b.cache, new.cache]),
                          BatchSampler.concat([b.sampler, new.sampler]), torch.cat([b.block, new.block]),
                          torch.cat([b.logits, new.logits]), torch.cat([b.steps, new.steps]),
                          torch.cat([b.limit, new.limit]), torch.cat([b.forwards, new.forwards]),
                          torch.cat([b.head, new.head]), self.rule_for(b.seqs + new.seqs), 0,
                          logprobs=b.logprobs + new.logprobs)

    def keep_rows(self, b: BlockBatch, keep: list[int]) -> None:
        idx = torch.tensor(keep, dtype=torch.long, device=self.engine.device)
        b.seqs = [b.seqs[r] for r in keep]
        b.cache.select(idx)
        b.sampler.select(keep)
        b.block, b.steps, b.limit, b.logits = b.block[idx], b.steps[idx], b.limit[idx], b.logits[idx]
        b.forwards, b.head = b.forwards[idx], b.head[idx]
        b.rule = self.rule_for(b.seqs)
        b.logprobs = [b.logprobs[r] for r in keep]
        if b.needed is not None:
            b.needed = b.needed[idx]

    # -- the block loop --------------------------------------------------------------------------------
    def _needed(self, b: BlockBatch) -> torch.Tensor:
        """`[N, B]`: masked positions that can still count — before the row's `limit` (a block cut by
        `max_new_tokens`) and before the first decided EOS (what follows an EOS is dropped, in rows that heed it;
        the prompt tokens of a block's `head` are not output). Only these are candidates for a step, so no step is
        ever spent on a token that would be thrown away."""
        e = self.engine
        masked = b.block == e.mask_id
        need = b.limit
        if e.eos_ids:
            where = ~masked & (self._positions[None] >= b.head[:, None])
            heeds = e.heeds_eos(b.seqs)
            need = through_eos(b.block, e.eos, b.limit, where=where if heeds is None else where & heeds[:, None])
        need = self._within_budget(b, need)
        return masked & (self._positions[None] < need[:, None])

    def _within_budget(self, b: BlockBatch, need: torch.Tensor) -> torch.Tensor:
        """`need` `[N]` lowered, in rows with a thinking budget (clover.engine.constraints.thinking), to the positions
        that are certainly the model's own: from the block's decided prefix, as many as the budget leaves before its
        closing sequence may be due. No position past the budget is decided before the prefix reaches it, and then the
        closing sequence is written there (`_force_closing`)."""
        rows = [r for r, s in enumerate(b.seqs) if s.budget is not None and not s.budget.done]
        if not rows:
            return need
        need = need.clone()
        block, head = b.block.tolist(), b.head.tolist()
        for r in rows:
            budget = b.seqs[r].budget
            start = self._prefix_end(block[r], head[r])
            free = budget.free(budget.after(block[r][head[r]:start]))
            if free is not None:
                need[r] = min(int(need[r]), start + free)
        return need

    def _prefix_end(self, row: list[int], head: int) -> int:
        """The end of a block row's decided prefix (from its `head`): its first masked position, or its end."""
        mask_id = self.engine.mask_id
        return row.index(mask_id, head) if mask_id in row[head:] else len(row)

    def _force_closing(self, seqs: list[Sequence], block: torch.Tensor, head: torch.Tensor,
                       limit: torch.Tensor) -> None:
        """Rows whose thinking budget is spent where their block's decided prefix ends: the closing sequence is
        written into the (masked) positions that follow, as far as the block and the row's `limit` go; what does
        not fit opens the next block. The block's other positions are then decoded after it."""
        rows = [r for r, s in enumerate(seqs) if s.budget is not None and not s.budget.done]
        if not rows:
            return
        tokens, heads, limits = block.tolist(), head.tolist(), limit.tolist()
        for r in rows:
            start = self._prefix_end(tokens[r], heads[r])
            forced = seqs[r].budget.forced_after(tokens[r][heads[r]:start])[: max(limits[r] - start, 0)]
            if forced:
                block[r, start:start + len(forced)] = torch.tensor(forced, dtype=torch.long, device=block.device)
                seqs[r].budget.forced_tokens += len(forced)

    def step(self, b: BlockBatch, snapshots: bool = False) -> tuple[list[Event], BlockBatch | None]:
        """One denoising step for every row that needs one, then the forward that feeds the next step."""
        e = self.engine
        logits = b.logits.clone()  # the sampler consumes its input
        # the previous step's check of what is still needed is this step's candidates: one `_needed` per step
        candidates = b.needed if b.needed is not None else self._needed(b)
        active = candidates.any(1)  # rows whose block is final sit this step out
        # a sampled position's noise is keyed by its answer position and the row's step in this block
        at = [len(s.generated) - h for s, h in zip(b.seqs, b.head.tolist())]
        tokens, confidence = b.sampler(logits, candidates, self._extension(b), at, b.steps.tolist())
        accept = b.rule.select(tokens, confidence, candidates)
        b.block = torch.where(accept, tokens, b.block)
        b.sampler.observe_block(tokens, accept)
        self._force_closing(b.seqs, b.block, b.head, b.limit)
        if any(row is not None for row in b.logprobs):
            self._record_logprobs(b, tokens, accept)
        b.steps += active
        b.step_index += 1
        e.counters.steps += 1
        events: list[Event] = self._snapshots(b, accept, active) if snapshots else []
        self._stop_early(b, active)

        b.needed = self._needed(b)
        if bool(b.needed.any()):
            # with the shift, query output p - 1 predicts position p: recompute it only where p is still needed;
            # position 0's prediction comes from the committed tokens and stays valid, so it alone needs no
            # forward. Without the shift, query output p predicts p.
            first = 1 if self.shift else 0
            wanted = b.needed[:, first:]
            if bool(wanted.any()):
                at = torch.cat([wanted, torch.zeros_like(wanted[:, :first])], dim=1)
                b.logits[:, first:][wanted] = e.forward(None, b.cache, query_ids=b.block, logits_at=at)
                b.forwards += wanted.any(1)  # a row whose block is final (or needs only position 0) was not fed
            return events, b
        events += self._finish_block(b)
        if not b.seqs:
            return events, None
        self._commit(b)
        return events, b

    def _no_logprobs(self, seqs: list[Sequence]) -> list[list[TokenLogprob | None] | None]:
        """A fresh block's logprobs: a position list per row that asks for them."""
        return [[None] * self.engine.block_size if s.options.logprobs is not None else None for s in seqs]

    def _record_logprobs(self, b: BlockBatch, tokens: torch.Tensor, accept: torch.Tensor) -> None:
        """The values of the tokens this step unmasked (rows asking for logprobs): from the prediction the step
        read for each position (`b.logits`, unconsumed: the sampler took a copy)."""
        for r, row in enumerate(b.logprobs):
            if row is None:
                continue
            at = accept[r].nonzero()[:, 0]
            if not at.numel():
                continue
            values = token_logprobs(b.logits[r, at], tokens[r, at].tolist(), b.seqs[r].options.logprobs,
                                    self.engine.banned_ids)
            for p, value in zip(at.tolist(), values):
                row[p] = value

    def _extension(self, b: BlockBatch) -> list[tuple[int, list[int]]] | None:
        """Per row, the block's decided tokens from its head to the first masked position: the history of the
        positions up to there (DRY and the repetition penalty read what comes before a position; after a masked
        one it is not known yet)."""
        if not b.sampler.uses_history:
            return None
        mask_id, out = self.engine.mask_id, []
        for row, head in zip(b.block.tolist(), b.head.tolist()):
            decided = row[head:]
            out.append((head, decided[: decided.index(mask_id)] if mask_id in decided else decided))
        return out

    def _stop_early(self, b: BlockBatch, active: torch.Tensor) -> None:
        """A row whose block's decided prefix completes a stop string is final now: its `limit` becomes the
        prefix's length up to the token that completes the string, so no step is spent after it. The output is
        the same as checking the finished block (the prefix never changes); only rows with stop strings that took
        this step decode any text."""
        e = self.engine
        rows = [r for r, s in enumerate(b.seqs) if s.options.stop]
        if not rows or e.detokenize is None:
            return
        act, block, limit, head = active.tolist(), b.block.tolist(), b.limit.tolist(), b.head.tolist()
        for r in rows:
            if not act[r]:
                continue
            prefix = block[r][head[r]: limit[r]]
            if e.mask_id in prefix:
                prefix = prefix[: prefix.index(e.mask_id)]
            cut = b.seqs[r].stop_cut(prefix, e.eos_of(b.seqs[r]), e.detokenize)
            if cut is not None:
                b.limit[r] = head[r] + cut

    def _snapshots(self, b: BlockBatch, accept: torch.Tensor, active: torch.Tensor) -> list[Event]:
        mask_id = self.engine.mask_id
        block, new, act = b.block.tolist(), accept.tolist(), active.tolist()
        return [StepSnapshot(s.seq_id, len(s.steps_per_block), int(b.steps[r]),
                             [None if t == mask_id else t for t in block[r]], new[r])
                for r, s in enumerate(b.seqs) if act[r]]

    def _finish_block(self, b: BlockBatch) -> list[Event]:
        """Every row's block is final: apply EOS / stop / length, emit the pieces, drop finished rows."""
        rows, steps, limits, forwards = b.block.tolist(), b.steps.tolist(), b.limit.tolist(), b.forwards.tolist()
        head = b.head.tolist()
        for s, row, h, lim in zip(b.seqs, rows, head, limits):
            if s.budget is not None and not s.budget.done:  # the budget follows the tokens that count (done: for good)
                s.budget.consume(before_eos(row[h:lim], self.engine.eos_of(s))[0])
        return self.engine.emit(b, [(rows[r][head[r]: limits[r]], steps[r], forwards[r]) for r in range(len(b.seqs))],
                                [lp[head[r]: limits[r]] if lp is not None else None for r, lp in enumerate(b.logprobs)])

    def _commit(self, b: BlockBatch) -> None:
        """The finished block joins the cache, in the same forward as the next block's first step."""
        e = self.engine
        n = len(b.seqs)
        if b.sampler.uses_history:  # the block joins each row's history (its head is the prompt's, already in)
            b.sampler.observe([row[h:] for row, h in zip(b.block.tolist(), b.head.tolist())])
        b.limit = self._limits(b.seqs)
        b.head = torch.zeros(n, dtype=torch.long, device=e.device)
        committed, b.block = b.block, e.masks(n)
        self._force_closing(b.seqs, b.block, b.head, b.limit)
        b.logits = self._open_block(committed, b.block, b.head, b.cache, b.limit,
                                    prefix_len=e.block_size if e.causal_context else 0)
        b.steps = torch.zeros(n, dtype=torch.long, device=e.device)
        b.forwards = b.steps + 1  # this forward feeds the new block's first step
        b.step_index = 0
        b.needed = None
        b.logprobs = self._no_logprobs(b.seqs)
