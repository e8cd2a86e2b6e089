"""Exact mode: drafts verified by the causal path. The output is block-size-1 decoding, token for token.

(Over the ~450-line mark on purpose: one role, the exact loop's step — plan, forward, verify, commit, rewind —
reading and writing one batch's state; what stands alone already lives beside it: drafting.py, cost.py, lookup.py,
draft_memory.py, speculative.py.)

Each forward reads, per row, the last decided token and `k` drafts causally (written to the cache), then a
query block of `m + 1` masks that drafts the `m` tokens after the one this forward decides:

    forward(clean = [last, d_1 .. d_k], query = m + 1 masks)
    c_0 .. c_k   the causal choice after each clean token
    accept       d_i while d_1..d_i == c_0..c_{i-1}: with `a` accepted the row commits c_0 .. c_a
    rewind       the cache keeps the row's first 1 + a clean tokens (the rejected drafts leave no trace)
    drafts       query output j predicts the token 2 + j positions after the last clean one; usable next
                 forward only where all k drafts were accepted (else they were made after a wrong token)

Every forward commits at least one token, each the model's causal choice given everything before it. Prompts are
read causally whatever the model's `prompt_reading` (block-size-1 decoding reads every token as its own block), and
a model without the token shift is refused: the causal path's choice is the output at the last committed token. With
sampling (temperature, top-k, top-p) the causal path's choice at each position is block size 1's draw there, its
noise keyed by the request's seed and the token's answer position (clover.engine.loops.speculative): a draft is
accepted when it equals that draw, so the output is distributed as sampling one token at a time and, with a seed,
is the same text whatever was drafted, whatever the batch.

After a rejection the query block's drafts were made after a wrong token: the next forward would verify nothing.
With `lookup` (the default) it verifies drafts copied from the request's own context instead
(clover.engine.drafts.lookup: the tokens that followed the latest earlier occurrence of the context's last n-gram), when
the context has one. With `memory` (the default too) it may take them from the answers the engine gave before
instead (clover.engine.drafts.draft_memory: the continuations earlier answers share with the context's longest matching
suffix, scored by how often they followed it), whichever source matches the deeper match; copied drafts may be
longer than a block (up to `COPIED_MOST`, as long as the match is deep). Their acceptance is estimated across
requests, per source and match depth: a copy that continues a twelve-token match is accepted nearly always, one
after a two-token match about half the time (`CONTEXT_PRIOR`). Where the model did draft (its last forward
accepted every draft) a copy still replaces its drafts when it promises more tokens (a long match being copied
goes on being copied, not three tokens at a time). Any draft is verified the same way, so where drafts come from
changes only the cost. `k` and `m`
change nothing in the output, only in the cost: `clover.engine.drafts.drafting` picks them per step and row from the
runner's measured cost (`clover.engine.drafts.cost`) and the request's acceptance so far (`adaptive`, the default), or
always the whole block (`adaptive=False`: `m = B - 1`, every draft verified). `m = 0` is a one-row forward with
no query block: block size 1 itself.

With a grammar (clover.engine.constraints.grammar, a request's `RequestOptions.grammar`) the causal logits are masked to the
allowed tokens before the choice, each draft's position with the grammar advanced past the drafts before it, so a
draft is checked against the masked choice; the query block drafts the allowed argmax. The tokens the grammar
forces after a decision (and an EOS when it can only end) are decided at once: they are emitted with it and fed,
with the last decided token, at the head of the next forward's clean tokens, so they cost no forward of their
own. Block size 1 (`m = 0`) does the same, so the output is constrained block-size-1 decoding, token for token.
A thinking budget (clover.engine.constraints.thinking) is consulted the same way: its closing sequence is the forced tokens,
and a draft past the budget is checked against them.

In floating point, verifying `k + 1` tokens in one forward and feeding them one at a time may be different sums
(~1e-5 apart in fp32 torch), so a near-tie between the two best tokens can flip; exact mode is block size 1 in
exact arithmetic, and token for token wherever the model's choice is not a near-tie. The int4 / int8 builds' CPU
kernels compute every row as a one-token forward does, bit for bit, so there it is block size 1 near-ties
included (docs/decoding.md).
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from clover.engine.drafts.cost import ForwardCost, cost_table, kept_table, shape_prior
from clover.engine.decoding import ExactRule
from clover.engine.drafts.draft_memory import MemoryDraft, copied_drafts
from clover.engine.drafts.drafting import Acceptance, best_batch_verified, best_drafts, best_verified, expected_tokens
from clover.engine.logprobs import TokenLogprob, token_logprobs
from clover.engine.drafts.lookup import ContextLookup
from clover.engine.loops.loop import DecodingLoop, Event
from clover.engine.request import Sequence, through_eos
from clover.engine.runner import RunnerCache
from clover.engine.sampling import BatchSampler
from clover.engine.loops.speculative import verify

STEP_EMA = 0.2  # weight of the newest step in the running estimate of the engine's own time per step
STEP_WINDOW = 9  # a step's time by forward size: the median of the last this many (a shared machine's slow
# moments are outliers)
COPIED_MOST = 15  # drafts copied (from the context or the memory) at most: 16 rows, the widest forward the cost
# table measures; fewer where the match is shallower (clover.engine.drafts.lookup)
MEMORY_PRIOR = 0.6  # acceptance assumed for memory drafts before any was verified (learned across requests)
MEMORY_BUCKETS = (4, 8, 16)  # match lengths that start a new acceptance estimate: a deeper match, surer drafts
CONTEXT_BUCKETS = (4, 8, 12)  # the same for drafts copied from the request's context, whose acceptance rises
# with the match's depth: a two-token match recurs by chance, a twelve-token one is text being copied
CONTEXT_PRIOR = (0.58, 0.78, 0.89, 0.98)  # their acceptance per bucket before any was verified, learned across
# requests from there (per token: benchmarks/replay_drafts.py over clover-smol's answers to the held-out sets,
# benchmarks/results/replay_heldout_int4.json)
STEP_SAMPLES = 3  # timings a size needs before they price it: one step timed in a slow moment of a shared machine
# would price its size high, and a size priced high is not run again to be re-timed (the int4 hybrid twin's 4-row
# steps, once timed at 1.9x a row instead of the table's 1.6x, were never tried again); until then the table's
# shape prices it from the nearest size timed that often
STEP_MEMORY = 512  # steps after which a size's timings no longer count: a size priced high during a slow moment
# is then no longer run, so never re-timed; once its timings age out it is priced from the sizes timed since


@dataclass
class ExactBatch:
    """Exact mode's running batch. Between steps, per row: the tokens the last forward decided (the causal
    path's tokens; emitted at the next step; all but the last already in the cache), the drafts for the next
    forward and the request's acceptance estimate; with `lookup`, its copied drafts (its context index, where its
    drafts came from)."""

    seqs: list[Sequence]
    cache: RunnerCache
    sampler: BatchSampler  # the rows' sampling (the target distribution and each row's seed)
    decided: torch.Tensor  # [N, W]: the first `n_decided` columns count
    n_decided: torch.Tensor  # [N], >= 1
    n_feed: torch.Tensor  # [N], >= 1: the last decided tokens not yet in the cache (the last one, and tokens a
    # grammar forced after it), fed at the head of the next forward
    drafts: torch.Tensor  # [N, D]: the tokens after the last decided one, as the query block predicted them
    n_drafts: torch.Tensor  # [N]: drafts usable next forward (0 where they were made after a rejected token)
    acceptance: list[Acceptance]
    copies: list[CopiedDrafts | None]
    looked_up: torch.Tensor  # [N] bool: this row's drafts were copied from its context, not drafted
    logprobs: list[list[TokenLogprob] | None]  # per row asking for them: the decided tokens' (else None)


@dataclass
class CopiedDrafts:
    """A request's copied drafts: the n-gram index of its own context, the drafting memory's draft when the
    current drafts came from there (None when from the context), and the depth of the match they continue."""

    index: ContextLookup
    memory_draft: MemoryDraft | None = None
    depth: int = 0


class ExactLoop(DecodingLoop):
    """The loop of rule `exact` (module docstring). `cost`: the runner's forward cost, taken as given (a known
    machine, tests); None: measured on first use (`cost_table`) and refined by timing the steps as they run."""

    name = "exact"

    def __init__(self, engine: Any, rule: ExactRule, cost: ForwardCost | None = None) -> None:
        super().__init__(engine)
        config = engine.runner.config
        if not config.token_shift:
            raise ValueError(
                f"rule 'exact' is undefined for this model (family {config.family!r}, token_shift false): exact mode "
                "verifies drafts against the causal path's next-token choice, the output at each committed token, and "
                "a model that predicts a masked position at that position has no next-token output there; use a "
                "block rule (e.g. 'threshold')")
        self.rule = rule
        # a runner that runs the causal path only (a hybrid model on llama.cpp) has no query block to draft with:
        # drafts come from the request's context alone
        self.causal_only = bool(getattr(engine.runner, "causal_only", False))
        self.cost = cost  # read or measured by `calibrate`, on the thread that runs the model, before the first forward
        self.learns = cost is None  # a given table is the policy's whole cost model
        self.measure_when_idle = False  # `cost` is `shape_prior`'s guess, to be measured when idle
        self.prior = list(getattr(engine.runner.config, "draft_acceptance", None) or []) or None
        self.overhead = 0.0  # seconds per step outside the runner, until a forward of a size has been timed
        self.steps = 0  # steps timed so far
        # the last (step, seconds) of a whole step, by the forward's rows; their medians, once per step
        self.step_time: dict[int, deque[tuple[int, float]]] = {}
        self._timed_cost: dict[int, float] | None = None
        self.drafted = [0] * engine.block_size  # forwards by the number of drafts their query block made
        # every request's drafts, by position: [accepted, verified]
        self.tally = [[0, 0] for _ in range(engine.block_size - 1)]
        self.lookup_most = COPIED_MOST if engine.block_size > 1 else 0  # drafts copied at most
        self.lookup_tally = [0, 0, 0]  # forwards that verified drafts from the context, drafts accepted, verified
        self.memory_tally = [0, 0, 0]  # the same for drafts from the drafting memory
        # acceptance of memory drafts by match length (`MEMORY_BUCKETS`), learned across requests (the memory is
        # shared by them) and not capped by one request's causal confidence
        self.memory_acceptance = [_shared_estimate(MEMORY_PRIOR) for _ in range(len(MEMORY_BUCKETS) + 1)]
        # acceptance of drafts copied from the context by match depth (`CONTEXT_BUCKETS`), likewise
        self.context_acceptance = [_shared_estimate(p) for p in CONTEXT_PRIOR]
        self._positions = torch.arange(engine.block_size, device=engine.device)

    def calibrate(self, defer: bool = False) -> None:
        """Read the runner's forward cost table, or measure it now (seconds, once for this model, runner and
        machine: real forwards, so on the thread that runs the model, before a cache holds rows: a llama.cpp runner
        of one row has none to spare). `defer` (an engine's own prefill: `clover generate`, `generate()`): where
        none is kept, the model's shape stands in (`shape_prior`) and the measurement waits for the engine's first
        idle moment (`idle`), so the first answer does not wait for it. The server calls it before its first
        request of this engine (clover.serving.scheduling.scheduler), and it measures then."""
        if self.cost is not None or not self.rule.adaptive:
            return
        self.cost = kept_table(self.engine.runner) if defer else cost_table(self.engine.runner)
        if self.cost is None:
            self.cost, self.measure_when_idle = shape_prior(self.engine.runner), True

    def idle(self) -> None:
        """No request in flight: measure the cost table that the shape prior stood in for, and decide by it."""
        if self.measure_when_idle:
            self.measure_when_idle = False
            self.cost = cost_table(self.engine.runner)

    def room(self, context: int, prompt_len: int, block_size: int) -> tuple[int, str]:
        # the last forward still carries a query block after at most B - 1 drafts
        return context - prompt_len - (block_size - 1), f"{block_size - 1} positions for drafting"

    def figures(self) -> dict[str, Any]:
        total = sum(self.drafted)
        return {"adaptive": self.rule.adaptive,
                "drafts_per_forward": round(sum(m * n for m, n in enumerate(self.drafted)) / total, 3) if total else 0,
                "forwards_by_drafts": list(self.drafted),
                "acceptance_by_position": [round(a / n, 4) if n else None for a, n in self.tally],
                "lookup": dict(zip(("forwards", "accepted", "verified"), self.lookup_tally)),
                "memory": {**dict(zip(("forwards", "accepted", "verified"), self.memory_tally)),
                           **(self.engine.memory.stats() if self.engine.memory is not None else {})},
                "forward_cost": self.cost.summary() if self.cost is not None else None}

    # -- batches ---------------------------------------------------------------------------------------
    def at_boundary(self, b: ExactBatch) -> bool:
        return True  # every step ends what it decided

    def join(self, b: ExactBatch, new: ExactBatch) -> ExactBatch:
        width = max(b.decided.shape[1], new.decided.shape[1])
        drafts = max(b.drafts.shape[1], new.drafts.shape[1])
        return ExactBatch(b.seqs + new.seqs, type(b.cache).concat([b.cache, new.cache]),
                          BatchSampler.concat([b.sampler, new.sampler]),
                          torch.cat([_pad(b.decided, width), _pad(new.decided, width)]),
                          torch.cat([b.n_decided, new.n_decided]), torch.cat([b.n_feed, new.n_feed]),
                          torch.cat([_pad(b.drafts, drafts), _pad(new.drafts, drafts)]),
                          torch.cat([b.n_drafts, new.n_drafts]), b.acceptance + new.acceptance,
                          b.copies + new.copies, torch.cat([b.looked_up, new.looked_up]), b.logprobs + new.logprobs)

    def keep_rows(self, b: ExactBatch, keep: list[int]) -> None:
        idx = torch.tensor(keep, dtype=torch.long, device=self.engine.device)
        b.seqs = [b.seqs[r] for r in keep]
        b.cache.select(idx)
        b.sampler.select(keep)
        b.decided, b.n_decided, b.n_feed = b.decided[idx], b.n_decided[idx], b.n_feed[idx]
        b.drafts, b.n_drafts = b.drafts[idx], b.n_drafts[idx]
        b.acceptance = [b.acceptance[r] for r in keep]
        b.copies = [b.copies[r] for r in keep]
        b.looked_up = b.looked_up[idx]
        b.logprobs = [b.logprobs[r] for r in keep]

    # -- the loop --------------------------------------------------------------------------------------
    def open(self, seqs: list[Sequence], ids: torch.Tensor, cache: RunnerCache, **kwargs: Any) -> ExactBatch:
        """The prefill's last chunk: it decides the first token (from the last prompt token) and drafts after it."""
        n, t = ids.shape
        e = self.engine
        sampler = BatchSampler([s.options.sampling for s in seqs], e.vocab_size, e.banned_ids, e.device, e.breakers)
        sampler.observe([s.prompt for s in seqs])
        acceptance = [Acceptance(e.block_size - 1, self.prior) for _ in seqs]
        none = torch.zeros(n, dtype=torch.long, device=e.device)
        m = self._plan(seqs, acceptance, none, cache.length + t)[1]
        start = torch.full((n,), t - 1, dtype=torch.long, device=e.device)
        constrained, masks, _ = _constraint_masks(seqs, lambda r: [])
        tokens, accepted, query, logprobs = self._forward(ids, start, none, cache, sampler, acceptance, int(m.max()),
                                                          masks, seqs, **kwargs)
        ones = accepted + 1
        copies = [CopiedDrafts(ContextLookup(s.prompt)) if self.rule.lookup else None for s in seqs]
        b = ExactBatch(seqs, cache, sampler, tokens, ones, ones.clone(), query, ones * query.shape[1], acceptance,
                       copies, none.bool(), logprobs)
        self._after_commit(b, constrained, accepted, [0] * n)
        self._observe(b)
        return b

    def step(self, b: ExactBatch, snapshots: bool = False) -> tuple[list[Event], ExactBatch | None]:
        """Emit what the last forward decided; then one forward verifies drafts and drafts anew."""
        e = self.engine
        start, forward_time = time.perf_counter(), e.counters.forward_time_s
        decided, counts = b.decided.tolist(), b.n_decided.tolist()
        events = e.emit(b, [(decided[r][: min(counts[r], s.remaining)], 1, 1) for r, s in enumerate(b.seqs)],
                        b.logprobs)
        e.counters.steps += 1
        if not b.seqs:
            return events, None

        if self.rule.lookup:
            self._look_up(b)
        k, m = self._plan(b.seqs, b.acceptance, b.n_drafts, b.cache.length + 1 + b.drafts.shape[1], b)
        k = self._before_eos(b, k)
        feed = int(b.n_feed.max())
        width = int((b.n_feed + k).max())
        # per row: the tokens to feed (left-aligned), its k drafts, then padding
        cols = torch.arange(width, device=e.device)[None]
        index = ((b.n_decided - b.n_feed)[:, None] + cols.clamp(max=feed - 1)).clamp(max=b.decided.shape[1] - 1)
        fed = b.decided.gather(1, index)
        drafts_in = _pad(b.drafts, width)[:, :width]
        at_draft = (cols - b.n_feed[:, None]).clamp(min=0)
        ids = torch.where(cols < b.n_feed[:, None], fed, drafts_in.gather(1, at_draft))
        real = cols < (b.n_feed + k)[:, None]
        ids = ids.masked_fill(~real, e.mask_id)
        kk = int(k.max())
        drafts_k = _pad(b.drafts, kk)[:, :kk]
        constrained, masks, consumed = _constraint_masks(b.seqs, lambda r: drafts_k[r, : int(k[r])].tolist())
        if width > 1:  # drafts to verify: the cache must be able to forget the rejected ones
            b.cache.mark()
        tokens, accepted, query, b.logprobs = self._forward(
            ids, b.n_feed - 1, k, b.cache, b.sampler, b.acceptance, int(m.max()), masks, b.seqs, prefix_len=width,
            attention_mask=None if bool(real.all()) else real, drafts_in=drafts_k)
        if width > 1:
            b.cache.rewind(b.n_feed + accepted)
        for r, (acc, verified, took) in enumerate(zip(b.acceptance, k.tolist(), accepted.tolist())):
            copied = b.copies[r]
            acc.tick()
            reached = min(took + 1, verified)  # drafts compared: accepted up to `took`, then one rejected
            if verified:
                source = "model" if not bool(b.looked_up[r]) else "memory" if copied.memory_draft else "context"
                counts = b.seqs[r].drafts.setdefault(source, [0, 0])
                counts[0] += took
                counts[1] += reached
            if bool(b.looked_up[r]):
                tally = self.lookup_tally
                if copied.memory_draft is not None:
                    tally = self.memory_tally
                    if verified:
                        estimate = self._memory_estimate(copied.memory_draft)
                        estimate.tick()
                        estimate.observe(verified, took)
                elif verified:
                    estimate = self._context_estimate(copied.depth)
                    estimate.tick()
                    estimate.observe(verified, took)
                tally[0] += verified > 0
                tally[1] += took
                tally[2] += reached
                continue
            acc.observe(verified, took)
            for i in range(reached):
                self.tally[i][0] += i < took
                self.tally[i][1] += 1
        b.decided, b.n_decided, b.n_feed = tokens, 1 + accepted, torch.ones_like(accepted)
        b.drafts = query
        b.n_drafts = torch.where(accepted == k, query.shape[1], 0)
        b.looked_up = torch.zeros_like(b.looked_up)
        self._after_commit(b, constrained, accepted, consumed)
        self._observe(b)
        self._timed(len(b.seqs) * (width + (int(m.max()) + 1 if int(m.max()) else 0)), start,
                    e.counters.forward_time_s - forward_time)
        return events, b

    def _observe(self, b: ExactBatch) -> None:
        """The decided tokens join each row's history for the penalties that read it (repetition, DRY)."""
        if b.sampler.uses_history:
            counts = b.n_decided.tolist()
            b.sampler.observe([row[:n] for row, n in zip(b.decided.tolist(), counts)])

    def _after_commit(self, b: ExactBatch, rows: list[int], accepted: torch.Tensor, consumed: list[int]) -> None:
        """The constrained `rows` (a grammar or a thinking budget, as the step began): the constraint follows what
        was committed (rejected drafts rolled back, the causal choice consumed), then the tokens it forces join the
        decided ones (fed at the next forward's head), and the drafts are redrawn as the allowed argmax after them
        (from the drafter's logits, `_query_logits`)."""
        if not rows:
            return
        decided = b.decided.tolist()
        acc = accepted.tolist()
        extra: dict[int, list[int]] = {}
        for r in rows:
            constraint = b.seqs[r].tracker
            if any(t in constraint.eos_ids for t in decided[r][: acc[r] + 1]):
                extra[r] = []  # the request ends here: its constraint is done with
                continue
            constraint.rollback(consumed[r] - acc[r])
            constraint.consume([decided[r][acc[r]]])
            extra[r] = constraint.forced()
        width = max(int(b.n_decided.max()), max(int(b.n_decided[r]) + len(extra[r]) for r in rows))
        b.decided = _pad(b.decided, width)
        for r in rows:
            n, f, constraint = int(b.n_decided[r]), extra[r], b.seqs[r].tracker
            if f:
                b.decided[r, n:n + len(f)] = torch.tensor(f, dtype=torch.long, device=b.decided.device)
            b.n_decided[r] += len(f)
            b.n_feed[r] += len(f)
            ends = bool(f) and f[-1] in constraint.eos_ids
            logits = self._query_logits[r, len(f):]  # query output j drafts slot j after the decided token
            drafts = constraint.draft(logits) if int(b.n_drafts[r]) and not ends and len(logits) else []
            b.drafts[r] = -1
            b.drafts[r, :len(drafts)] = torch.tensor(drafts, dtype=torch.long, device=b.drafts.device)
            b.n_drafts[r] = len(drafts)

    def _timed(self, rows: int, start: float, forward: float) -> None:
        """What a step of a forward of `rows` rows took, whole (the runner's forward, undoing rejected drafts,
        the engine's own work): the policy's cost of that size from now on (the table gives the rest)."""
        total = time.perf_counter() - start
        self.overhead += STEP_EMA * (total - forward - self.overhead)
        self.steps += 1
        self.step_time.setdefault(rows, deque(maxlen=STEP_WINDOW)).append((self.steps, total))
        self._timed_cost = None

    def _step_cost(self, rows: int, context: int) -> float:
        """Seconds a step of `rows` rows costs: as timed in the last `STEP_MEMORY` steps (at least `STEP_SAMPLES`
        times); else the table's forward scaled as the nearest size timed then compares with the table (a batch's
        rows are separate sequences, dearer than one sequence's rows, which the table times); else, before any
        size was timed, the table's forward plus the engine's time."""
        if self.learns and self._timed_cost is None:
            recent = {size: [t for step, t in timed if step > self.steps - STEP_MEMORY]
                      for size, timed in self.step_time.items()}
            self._timed_cost = {size: statistics.median(times) for size, times in recent.items()
                                if len(times) >= STEP_SAMPLES}
        timed = self._timed_cost if self.learns else None
        if not timed:
            return self.cost(rows, context) + self.overhead
        if rows in timed:
            return timed[rows]
        near = min(timed, key=lambda size: abs(math.log(size / rows)))
        return self.cost(rows, context) * timed[near] / self.cost(near, context)

    def _look_up(self, b: ExactBatch) -> None:
        """Rows left without drafts take the continuation their context offers, or the drafting memory's when it
        matches the context deeper; with the adaptive policy, rows the model drafted for take it too where it
        promises more tokens (module docstring). Each row's index first reads the tokens the request committed
        since (emitted at this step's start)."""
        most = self.lookup_most
        n_drafts = b.n_drafts.tolist()
        for r, (s, copied) in enumerate(zip(b.seqs, b.copies)):
            copied.index.extend(s.generated[len(copied.index) - len(s.prompt):])
            copied.memory_draft = None
            if (n_drafts[r] and not self.rule.adaptive) or s.remaining <= 1:
                continue
            drafts, memory_draft, depth = copied_drafts(copied.index, s.options.memory, most)
            if drafts and n_drafts[r]:  # the model drafted too: the copy replaces its drafts where it promises more
                copied.memory_draft, copied.depth = memory_draft, depth
                promised = expected_tokens(self._copied_estimate(b, r), len(drafts))
                if promised <= expected_tokens(b.acceptance[r].optimistic(), n_drafts[r]):
                    copied.memory_draft = None
                    continue
            copied.memory_draft, copied.depth = memory_draft, depth
            if drafts:
                b.drafts = _pad(b.drafts, len(drafts))
                b.drafts[r] = -1
                b.drafts[r, :len(drafts)] = torch.tensor(drafts, dtype=torch.long, device=b.drafts.device)
                b.n_drafts[r] = len(drafts)
                b.looked_up[r] = True

    def _memory_estimate(self, draft: MemoryDraft) -> Acceptance:
        """The shared acceptance estimate of memory drafts that matched as deep as `draft` did."""
        return self.memory_acceptance[sum(draft.match >= edge for edge in MEMORY_BUCKETS)]

    def _context_estimate(self, depth: int) -> Acceptance:
        """The shared acceptance estimate of context drafts that matched as deep as `depth`."""
        return self.context_acceptance[sum(depth >= edge for edge in CONTEXT_BUCKETS)]

    def _copied_estimate(self, b: ExactBatch, r: int, optimistic: bool = True) -> list[float]:
        """`p_i` of row `r`'s copied drafts: for context drafts, how often such drafts were accepted at that match
        depth; for memory drafts, the share of earlier occurrences that went on with each token, capped by how
        often such drafts were accepted. `optimistic`: each estimate's `Acceptance.optimistic()`, else its mean."""
        copied = b.copies[r]
        estimate = self._context_estimate(copied.depth) if copied.memory_draft is None else \
            self._memory_estimate(copied.memory_draft)
        p = estimate.optimistic()[0] if optimistic else estimate.mean()[0]
        if copied.memory_draft is None:
            return [p] * self.lookup_most
        return [min(share, p) for share in copied.memory_draft.conditional]

    def _copies_to_verify(self, b: ExactBatch, r: int, cost: Callable[[float], float], most: int,
                          query: int) -> int:
        """How many of row `r`'s copied drafts (at most `most`) a forward carrying `query` masks verifies: as many
        as pay by the estimate's mean (`best_verified`: the most committed tokens per second expected), not by its
        optimistic bound, which overstates `p` while evidence is thin and so verifies drafts that are mostly
        rejected past the first few (the int4 hybrid twin at p = 0.7: 7 verified for 2.3 tokens a forward, 0.96x
        block size 1). Where none pays by the mean but one would by the optimistic bound, one is verified: a draft
        not verified teaches the estimate nothing, and one is the cheapest to learn from."""
        k = best_verified(self._copied_estimate(b, r, optimistic=False), cost, most, query)
        if k == 0 and most and best_verified(self._copied_estimate(b, r), cost, most, query):
            return 1
        return k

    def _plan(self, seqs: list[Sequence], acceptance: list[Acceptance], available: torch.Tensor,
              context: int, b: ExactBatch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: `k` drafts to verify (of those available) and `m` to draft next. None past the request's
        last token: the decided token is one, the drafts verified next time need one more each. Drafts copied
        from the context (`b.looked_up`) are verified as far as they pay in this forward by their own acceptance
        estimate (`best_verified`)."""
        e = self.engine
        most = e.block_size - 1
        remaining = [s.remaining for s in seqs]
        avail = available.tolist()
        # this step's price of each forward size, asked again by every row and estimate (at p = 0 the 16 sizes,
        # twice: by the estimate's mean and by its optimistic bound)
        cost = functools.cache(lambda rows: self._step_cost(rows, context))
        if self.causal_only:  # no query block to draft with: only drafts copied from the context are verified
            ks = [min(a, max(left - 1, 0)) for a, left in zip(avail, remaining)]
            if self.rule.adaptive:
                ks = [self._copies_to_verify(b, r, cost, k, 0) if b is not None and bool(b.looked_up[r]) else k
                      for r, k in enumerate(ks)]
                if len(seqs) > 1:  # one forward as wide as its widest row
                    ks = [min(k, max(ks)) for k in ks]
            zeros = torch.zeros(len(seqs), dtype=torch.long, device=e.device)
            return torch.tensor(ks, dtype=torch.long, device=e.device), zeros
        if self.rule.adaptive and len(seqs) > 1:
            ks, ms = self._plan_batch(acceptance, avail, remaining, context, b)
        else:
            ks, ms = [], []
            for r, acc in enumerate(acceptance):
                if self.rule.adaptive:
                    want = best_drafts(acc.optimistic(), cost, most)
                    verify = want
                    if b is not None and bool(b.looked_up[r]):
                        verify = self._copies_to_verify(b, r, cost, avail[r], want + 1 if want else 0)
                else:
                    want = verify = most
                k = min(avail[r], verify, max(remaining[r] - 1, 0))
                ks.append(k)
                ms.append(min(want, max(remaining[r] - k - 2, 0)))
        device = e.device
        return torch.tensor(ks, dtype=torch.long, device=device), torch.tensor(ms, dtype=torch.long, device=device)

    def _plan_batch(self, acceptance: list[Acceptance], avail: list[int], remaining: list[int], context: int,
                    b: ExactBatch | None) -> tuple[list[int], list[int]]:
        """`_plan` for a batch, whose forward is as wide as its widest row (clover.engine.drafts.drafting): one number
        of drafts to make for every row, from the rows' mean acceptance with each row paying its share of the
        batch's rows, and one number to verify, the best for the whole forward, each row's drafts judged by their
        own estimate (copied ones by the lookup's)."""
        n, most = len(acceptance), self.engine.block_size - 1
        estimates = [acc.optimistic() for acc in acceptance]
        mean = [sum(column) / n for column in zip(*estimates)]
        want = best_drafts(mean, lambda rows: self._step_cost(n * rows, context) / n, most)
        ps = [self._copied_estimate(b, r) if b is not None and bool(b.looked_up[r]) else estimates[r]
              for r in range(n)]
        usable = [min(a, max(left - 1, 0)) for a, left in zip(avail, remaining)]
        k = best_batch_verified(ps, usable, lambda rows: self._step_cost(rows, context), want + 1 if want else 0)
        ks = [min(k, a) for a in usable]
        return ks, [min(want, max(left - kr - 2, 0)) for left, kr in zip(remaining, ks)]

    def _before_eos(self, b: ExactBatch, k: torch.Tensor) -> torch.Tensor:
        """No draft after a drafted EOS is worth verifying (what follows an EOS is dropped, in rows that heed it)."""
        e = self.engine
        if not e.eos_ids or not b.drafts.shape[1]:
            return k
        heeds = e.heeds_eos(b.seqs)
        return through_eos(b.drafts, e.eos, k, where=None if heeds is None else heeds[:, None].expand_as(b.drafts))

    def _forward(self, ids: torch.Tensor, start: torch.Tensor, k: torch.Tensor, cache: RunnerCache,
                 sampler: BatchSampler, acceptance: list[Acceptance], drafts: int,
                 masks: list[torch.Tensor | None], seqs: list[Sequence], drafts_in: torch.Tensor | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[TokenLogprob] | None]]:
        """Forward `ids` `[N, T]` as causal clean tokens (written to the cache) and, when `drafts > 0`, a query
        block of `drafts + 1` masks. Row `r`'s logits at clean positions `start[r] .. start[r] + k[r]` decide the
        token after the last fed token and after each of its `k[r]` drafts `drafts_in[r]` (masked by the row's
        grammar, `masks[r]` `[1 + k[r], V]`, where it has one); the rows' sequences `seqs` give the answer position
        of the token decided after the last fed one (the tokens the row has decided so far), which keys a sampled
        row's noise (clover.engine.loops.speculative), and the logprobs each asks for. Returns the committed tokens
        `[N, 1 + max k]` (-1 after each row's), the drafts accepted `[N]` and `[N, drafts]` new drafts: query output `j` predicts the
        token two positions after the last clean one plus `j` (the mask at query position 0 stands for the token
        this forward decides); their logits stay in `_query_logits` for a grammar's drafts. Last, per row that asks
        for logprobs, its committed tokens' (clover.engine.logprobs: from the causal logits, before any mask or
        sampling transform touches them; None for the other rows)."""
        e = self.engine
        n, t = ids.shape
        self.drafted[drafts] += 1
        kk = int(k.max()) if k.numel() else 0
        query = drafts + 1 if drafts else 0
        # logits at each row's deciding positions and the query outputs that draft
        at = torch.zeros(n, t + query, dtype=torch.bool, device=e.device)
        if n == 1:  # one slice (the indexed write below costs ~0.1 ms, a step's worth of the loop's own work)
            first = int(start[0])
            at[0, first:first + kk + 1] = True
        else:
            cols = torch.arange(kk + 1, device=e.device)
            rows = torch.arange(n, device=e.device)[:, None].expand(n, kk + 1)
            wanted = cols[None] <= k[:, None]
            at[rows[wanted], (start[:, None] + cols[None])[wanted]] = True
        at[:, t:t + drafts] = True
        out = e.forward(ids, cache, block_size=max(query, 1), query_ids=e.masks(n, query) if query else None,
                        logits_at=at, **kwargs)
        if n == 1 or bool(wanted.all()):  # every row verifies `kk` drafts: `out` is already [N, kk + 1 + drafts]
            logits = out.view(n, kk + 1 + drafts, out.shape[-1])
        else:
            logits = out.new_zeros(n, kk + 1 + drafts, out.shape[-1])
            logits[torch.cat([wanted, torch.ones(n, drafts, dtype=torch.bool, device=e.device)], dim=1)] = out
        tops = [s.options.logprobs for s in seqs]
        positions = [len(s.generated) for s in seqs]
        asked = [r for r, top in enumerate(tops) if top is not None]
        raw = logits[asked, :kk + 1] if asked else None  # a copy: `verify` consumes `logits`
        for r, mask in enumerate(masks):
            if mask is not None:
                logits[r, : mask.shape[0]].masked_fill_(~mask.to(logits.device), float("-inf"))
        if drafts_in is None:
            drafts_in = torch.zeros(n, kk, dtype=torch.long, device=e.device)
        accepted, tokens = verify(sampler, logits[:, :kk + 1], drafts_in, k, positions, check=False)
        if self.rule.adaptive and not self.causal_only:  # the causal path's probability of each token it
            # committed, over the positions some row committed (a policy signal: on fp32 logits `verify` has set
            # banned ids to -inf in place; it caps the estimate of the model's own drafts, which a causal-only
            # runner never makes: a softmax over the vocabulary a step saved there)
            took = accepted.tolist()
            confidence = logits[:, :max(took) + 1].float().softmax(-1).amax(-1).tolist()
            for acc, row, a in zip(acceptance, confidence, took):
                acc.observe_confidence(row[: a + 1])
        # the drafter's logits: fp32, the ids that may never be emitted at -inf (drafts are point masses: argmax)
        self._query_logits = logits[:, kk + 1:].float()
        self._query_logits[..., e.banned_ids] = float("-inf")
        logprobs: list[list[TokenLogprob] | None] = [None] * n
        if raw is not None:
            committed, took = tokens.tolist(), accepted.tolist()
            for i, r in enumerate(asked):
                logprobs[r] = token_logprobs(raw[i], committed[r][: took[r] + 1], tops[r], e.banned_ids)
        return tokens, accepted, self._query_logits.max(dim=-1).indices, logprobs


def _shared_estimate(prior: float) -> Acceptance:
    """An acceptance estimate of one kind of copied drafts, shared by every request (so not capped by one
    request's causal confidence)."""
    estimate = Acceptance(1, [prior])
    estimate.confidence = 1.0
    return estimate


def _constraint_masks(seqs: list[Sequence], drafts: Callable[[int], list[int]]
                      ) -> tuple[list[int], list[torch.Tensor | None], list[int]]:
    """The rows a constraint binds, decided from the committed tokens before a forward (the drafts its masks consume
    may end a thinking budget, then be rejected: the rollback must still reach them), and per row the masks of the
    decision and the position after each of row r's `drafts(r)`, and how many drafts the constraint consumed."""
    rows = [r for r, s in enumerate(seqs) if s.constraint is not None]
    masks: list[torch.Tensor | None] = [None] * len(seqs)
    consumed = [0] * len(seqs)
    for r in rows:
        masks[r], consumed[r] = seqs[r].constraint.masks_for(drafts(r))
    return rows, masks, consumed


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """`t` `[N, w]` right-padded with -1 to `width` columns (or unchanged when already as wide)."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1) if t.shape[1] < width else t
