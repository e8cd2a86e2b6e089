"""The block-diffusion decoding loop: prefill, denoising steps, block commit, batching, streaming.

(About 480 lines: prefill, step, commit and the continuous-batching entry points all act on the one running batch
and share its invariants; exact mode's step and the reference decoder already live apart, in exact.py and
reference.py, and splitting the block loop further would scatter one state machine over files.)

One request, block size `B` (docs/decoding.md has the full semantics):

    prefill   forward(prompt as causal clean tokens, query = B masks)      -> logits for step 1 of block 1
    step      fill positions chosen by the unmasking rule
              block not done: forward(query = current block)               -> logits for the next step
              block done:     emit it; forward(clean = block, query = B masks) -> commit + step 1 of the next block

The prediction for block position `p` is the output one position to its left (token shift): for `p = 0` the
clean logits of the last committed token, for `p >= 1` query output `p - 1`. So every step consumes exactly one
forward, and a block decided in one step costs one forward. With `B = 1` no query block is needed at all and the
loop is exactly AR decoding. The LM head runs only for positions that can still be filled (`logits_at`): on a
small model with a large vocabulary it is a fifth of a token's compute, and after the first step of a block
most positions are decided. When only position 0 is left, whose prediction does not depend on the block, the
step needs no forward at all.

Batches run in lockstep, block by block: prompts are left-padded into one prefill, every row's block is committed
in the same forward, and a row whose block is already final sits out the remaining steps of the others (its
outputs are ignored and it draws no random numbers), so each request gets exactly what it gets alone. A finished
request leaves the batch (`cache.select`) at the next commit.

Continuous batching (the server's scheduler) uses the same loop one request at a time: `begin_prefill` +
`prefill_step` prefill a request alone, chunk by chunk on the absolute grid of `prefill_chunk` (optionally from a
cache that already holds a prefix of its prompt: prefix reuse), `join` adds it to a running batch at a block
boundary (the cache's `concat`), `step` advances the batch by one denoising step, and
`drop` removes cancelled requests at any step.

Exact mode (a rule that `verifies`: `exact`) runs its own step, `ExactMode._exact_step` (clover/engine/exact.py),
on the same prefill, batching and emission: its output is block-size-1 greedy decoding, token for token.

The network runs behind `clover.engine.runner` (the torch model, or llama.cpp for a GGUF): `_forward` is the one
call into it.

Where things happen: `Engine._prefill` (prompt -> cache), `Engine._step` (one denoising step),
`Engine._finish_block` (EOS / stop / length, emit), `Engine._commit` (the block joins the cache).
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence as Seq

import torch

from clover.engine.decoding import UnmaskingRule, make_rule
from clover.engine.exact import ExactBatch, ExactMode
from clover.engine.sampling import BatchSampler, SamplingParams
from clover.engine.request import Detokenize, Request
from clover.engine.runner import ModelRunner, RunnerCache, as_runner

DEFAULT_PREFILL_CHUNK = 2048


@dataclass
class StreamPiece:
    """The committed tokens of one block of one request (what a streaming client appends)."""

    index: int  # the request's position in the prompts given to the engine
    token_ids: list[int]
    block: int
    finished: bool = False
    finish_reason: str | None = None
    stats: dict[str, Any] | None = None  # on a request's last piece


@dataclass
class StepSnapshot:
    """The state of a block after one denoising step (for visualisation)."""

    index: int
    block: int
    step: int  # 1-based within the block
    tokens: list[int | None]  # None: still masked
    new: list[bool]  # filled in this step


Event = StreamPiece | StepSnapshot


@dataclass
class BlockBatch:
    """The tensors of the requests being block-decoded together (row r is `seqs[r]`)."""

    seqs: list[Request]
    cache: RunnerCache
    sampler: BatchSampler
    block: torch.Tensor  # [N, B] current block, mask id where undecided
    logits: torch.Tensor  # [N, B, V] the prediction for each block position (token shift applied); current
    # where the position is still needed, stale or zero elsewhere
    steps: torch.Tensor  # [N] steps each row has taken in this block
    limit: torch.Tensor  # [N] positions of this block that can count: min(B, tokens the row may still produce),
    # or fewer once a stop string is complete in the block's decided prefix
    forwards: torch.Tensor  # [N] forwards that fed this row's steps in this block (a step may need none)
    step_index: int = 0
    needed: torch.Tensor | None = None  # [N, B] `Engine._needed` as the last step left it; None on a fresh block


DecodeBatch = BlockBatch | ExactBatch  # the running batch, opaque outside the engine (the scheduler holds it)


@dataclass
class Prefill:
    """A request being prefilled on its own, one chunk per `Engine.prefill_step`, before it joins a batch."""

    seq: Request
    cache: RunnerCache  # one row; holds `done` prompt tokens
    done: int = 0


@dataclass
class EngineCounters:
    """Batch-level figures, for benchmarks: engine overhead = wall time - forward time."""

    forwards: int = 0
    forward_time_s: float = 0.0
    steps: int = 0


class Engine(ExactMode):
    """Decodes batches of prompts with one model, block size and unmasking rule.

    `vocab_limit`: ids >= it are never emitted (a padded embedding matrix larger than the tokenizer);
    `detokenize`: ids -> text, needed only for stop strings; `prefill_chunk`: prompt tokens per prefill forward,
    which bounds the prefill's activation memory for long prompts.
    """

    def __init__(self, model: torch.nn.Module | ModelRunner, block_size: int | None = None,
                 threshold: float | None = None, rule: str | UnmaskingRule = "threshold",
                 rule_options: dict[str, Any] | None = None, *,
                 eos_token_ids: Seq[int] | None = None, vocab_limit: int | None = None,
                 detokenize: Detokenize | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> None:
        self.runner = as_runner(model)
        config = self.runner.config
        self.block_size = config.block_size if block_size is None else int(block_size)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        threshold = config.threshold if threshold is None else threshold
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        self.rule = make_rule(rule, threshold=threshold, **(rule_options or {}))
        if config.mask_token_id is None:
            raise ValueError("the model's config has no mask_token_id; block decoding needs one "
                             "(`clover convert` adds it)")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.mask_id = config.mask_token_id
        self.exact = self.rule.verifies
        # committed blocks read causally (each token its own block) instead of bidirectionally inside the block
        self.causal_context = config.context_reading == "causal"
        self.eos_ids = list(config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.vocab_size = config.vocab_size
        self.vocab_limit = self.vocab_size if vocab_limit is None else min(int(vocab_limit), self.vocab_size)
        self.detokenize = detokenize
        self.prefill_chunk = prefill_chunk
        self.device = self.runner.device
        self._eos = torch.tensor(self.eos_ids, dtype=torch.long, device=self.device)
        self._banned_ids = torch.tensor(self._banned(), dtype=torch.long, device=self.device)
        self._positions = torch.arange(self.block_size, device=self.device)
        self.counters = EngineCounters()

    # -- public ---------------------------------------------------------------------------------------
    def run(self, prompts: Seq[Seq[int]], max_new_tokens: int, sampling: SamplingParams | Seq[SamplingParams],
            snapshots: bool = False) -> Iterator[Event]:
        """Decode `prompts` together; yield a `StreamPiece` per request per block (and `StepSnapshot`s).

        Inputs are validated here, before the first `next()`, so a bad request fails where it is made."""
        return self._run(self.make_sequences(prompts, max_new_tokens, sampling), snapshots)

    def _run(self, seqs: list[Request], snapshots: bool) -> Iterator[Event]:
        with torch.inference_mode():
            batch = self._prefill(seqs)
        while batch is not None:
            with torch.inference_mode():  # not around the yield: the caller's code must not run in this mode
                events, batch = self._step(batch, snapshots)
            yield from events

    # -- setup ----------------------------------------------------------------------------------------
    def make_sequences(self, prompts: Seq[Seq[int]], max_new_tokens: int,
                       sampling: SamplingParams | Seq[SamplingParams]) -> list[Request]:
        """Validated requests (`ValueError` naming the parameter otherwise), timed from now."""
        if len(prompts) == 0:
            raise ValueError("prompts is empty: give at least one prompt")
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if self.detokenize is None and any(p.stop for p in params):
            raise ValueError("stop strings need a detokenizer: pass detokenize=tokenizer.decode")
        if self.exact:
            for i, p in enumerate(params):
                if not p.greedy or p.repetition_penalty != 1.0:
                    raise ValueError(
                        f"rule {self.rule.name!r} is greedy decoding (its output is the model's own greedy output): "
                        f"request {i} has temperature={p.temperature}, repetition_penalty={p.repetition_penalty}; "
                        "use temperature=0 and repetition_penalty=1, or another rule")
        prompts = [list(map(int, p)) for p in prompts]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size}): {bad[:5]}")
        limit = self.runner.config.max_position_embeddings
        longest = max(len(p) for p in prompts)
        if self.exact:  # the last forward still carries a query block of B masks after at most B - 1 drafts
            reach, why = max_new_tokens + self.block_size - 1, f"max_new_tokens plus {self.block_size - 1} for drafting"
            fits = limit - longest - (self.block_size - 1)
        else:  # the last block occupies B positions
            reach = math.ceil(max_new_tokens / self.block_size) * self.block_size
            why = f"max_new_tokens rounded up to whole blocks of {self.block_size}"
            fits = (limit - longest) // self.block_size * self.block_size
        if longest >= limit:
            raise ValueError(f"a prompt of {longest} tokens leaves no room for max_new_tokens within the model's "
                             f"max_position_embeddings={limit}")
        if longest + reach > limit:
            raise ValueError(
                f"max_new_tokens={max_new_tokens} is too large: the prompt has {longest} tokens and generation "
                f"needs {reach} more positions ({why}), beyond the model's max_position_embeddings={limit}; at most "
                f"{max(fits, 0)} new tokens fit")
        now = time.perf_counter()
        return [Request(i, p, params[i], int(max_new_tokens), start_time=now) for i, p in enumerate(prompts)]


    def _forward(self, ids: torch.Tensor | None, cache: RunnerCache, **kwargs: Any) -> torch.Tensor:
        """The runner's logits for one forward (`clover.engine.runner`), timed and counted."""
        start = time.perf_counter()
        out = self.runner.forward(ids, self.block_size, cache=cache, **kwargs)
        self.counters.forward_time_s += time.perf_counter() - start
        self.counters.forwards += 1
        return out

    def _masks(self, n: int) -> torch.Tensor:
        return torch.full((n, self.block_size), self.mask_id, dtype=torch.long, device=self.device)

    # -- prefill --------------------------------------------------------------------------------------
    def _prefill(self, seqs: list[Request]) -> DecodeBatch:
        """Prompts, left-padded, read causally in chunks of `prefill_chunk`; the last chunk carries block 1's masks
        as a query block, so the prefill is also block 1's first step."""
        n, longest = len(seqs), max(len(s.prompt) for s in seqs)
        ids = torch.full((n, longest), self.mask_id, dtype=torch.long)
        valid = torch.zeros(n, longest, dtype=torch.bool)
        for r, s in enumerate(seqs):
            ids[r, longest - len(s.prompt):] = torch.tensor(s.prompt)
            valid[r, longest - len(s.prompt):] = True
        ids, valid = ids.to(self.device), valid.to(self.device)
        padded = not bool(valid.all())
        cache = self.runner.new_cache(n)
        limit = self._limits(seqs)
        chunks = range(0, longest, self.prefill_chunk)
        for s in seqs:
            s.prefill_forwards = len(chunks)
        for start in chunks:
            end = min(start + self.prefill_chunk, longest)
            kwargs = dict(prefix_len=end - start, attention_mask=valid[:, start:end] if padded else None)
            if end < longest:
                self._forward(ids[:, start:end], cache, logits_to_keep=0, **kwargs)
            elif self.exact:
                return self._exact_open(seqs, ids[:, start:end], cache, **kwargs)
            else:
                logits = self._open_block(ids[:, start:end], cache, limit, **kwargs)
        sampler = BatchSampler([s.params for s in seqs], self.vocab_size, self._banned(), self.device)
        sampler.observe([s.prompt for s in seqs])
        zeros = torch.zeros(n, dtype=torch.long, device=self.device)
        return BlockBatch(seqs, cache, sampler, self._masks(n), logits, zeros, limit, zeros + 1)

    def _open_block(self, ids: torch.Tensor, cache: RunnerCache, limit: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Forward clean `ids` `[N, T]` with a fresh block of masks as the query: `[N, B, V]` predictions for the
        block's positions (0 from the last clean token, `p >= 1` from query output `p - 1`), computed only
        before each row's `limit` (zeros beyond it)."""
        n, t = ids.shape
        b = self.block_size
        wanted = self._positions[None] < limit[:, None]  # [N, B]
        at = torch.zeros(n, t + (b if b > 1 else 0), dtype=torch.bool, device=self.device)
        at[:, t - 1] = wanted[:, 0]
        at[:, t:t + b - 1] = wanted[:, 1:]
        out = self._forward(ids, cache, query_ids=self._masks(n) if b > 1 else None, logits_at=at, **kwargs)
        logits = out.new_zeros(n, b, out.shape[-1])
        logits[wanted] = out
        return logits

    def _limits(self, seqs: list[Request]) -> torch.Tensor:
        return torch.tensor([min(self.block_size, s.remaining) for s in seqs], dtype=torch.long, device=self.device)

    # -- continuous batching: one request at a time -------------------------------------------------------
    def begin_prefill(self, seq: Request, cache: RunnerCache | None = None) -> Prefill:
        """Start prefilling `seq` alone. `cache` (one row) may already hold a prefix of its prompt (prefix reuse);
        it must end on the chunk grid and leave at least one prompt token, whose logits start decoding."""
        cache = cache if cache is not None else self.runner.new_cache(1)
        done = cache.length
        if cache.batch_size != 1 or done % self.prefill_chunk or done >= len(seq.prompt):
            raise ValueError(f"a reused prefix must be one row ending on the {self.prefill_chunk}-token grid before "
                             f"the prompt's end; got {cache.batch_size} rows, {done} of {len(seq.prompt)} tokens")
        seq.prefill_forwards = 0
        return Prefill(seq, cache, done)

    def prefill_step(self, p: Prefill) -> DecodeBatch | None:
        """One prefill chunk, ending on the absolute grid of `prefill_chunk` tokens — so a prefill resumed from a
        reused prefix runs exactly the forwards of a cold one, and gives the same bits. The last chunk carries the
        first block's masks (as `_prefill` does); it returns the request as a one-row batch, else None."""
        prompt = p.seq.prompt
        end = min((p.done // self.prefill_chunk + 1) * self.prefill_chunk, len(prompt))
        last = end == len(prompt)
        ids = torch.tensor([prompt[p.done:end]], dtype=torch.long, device=self.device)
        limit = self._limits([p.seq])
        p.seq.prefill_forwards += 1
        with torch.inference_mode():
            if not last:
                self._forward(ids, p.cache, prefix_len=end - p.done, logits_to_keep=0)
            elif self.exact:
                opened = self._exact_open([p.seq], ids, p.cache, prefix_len=end - p.done)
            else:
                logits = self._open_block(ids, p.cache, limit, prefix_len=end - p.done)
        p.done = end
        if not last:
            return None
        if self.exact:
            return opened
        sampler = BatchSampler([p.seq.params], self.vocab_size, self._banned(), self.device)
        sampler.observe([prompt])
        zeros = torch.zeros(1, dtype=torch.long, device=self.device)
        return BlockBatch([p.seq], p.cache, sampler, self._masks(1), logits, zeros, limit, zeros + 1)

    def at_block_boundary(self, b: DecodeBatch) -> bool:
        """No step of the current block taken yet: rows can join. In exact mode every step ends one."""
        return isinstance(b, ExactBatch) or b.step_index == 0

    def join(self, b: DecodeBatch | None, new: DecodeBatch) -> DecodeBatch:
        """`new` (prefilled, at the start of its first block) joins the running batch `b` at a block boundary.
        Each row keeps exactly what it would get alone: its cache rows, logits and random stream are its own."""
        if b is None:
            return new
        if not (self.at_block_boundary(b) and self.at_block_boundary(new)):
            raise ValueError("requests join a batch only at a block boundary")
        if isinstance(b, ExactBatch):
            return ExactBatch(b.seqs + new.seqs, type(b.cache).concat([b.cache, new.cache]),
                               torch.cat([b.decided, new.decided]), torch.cat([b.n_decided, new.n_decided]),
                               torch.cat([b.drafts, new.drafts]), torch.cat([b.n_drafts, new.n_drafts]))
        return BlockBatch(b.seqs + new.seqs, type(b.cache).concat([b.cache, new.cache]),
                      BatchSampler.concat([b.sampler, new.sampler]), torch.cat([b.block, new.block]),
                      torch.cat([b.logits, new.logits]), torch.cat([b.steps, new.steps]),
                      torch.cat([b.limit, new.limit]), torch.cat([b.forwards, new.forwards]), 0)

    def step(self, b: DecodeBatch, snapshots: bool = False) -> tuple[list[Event], DecodeBatch | None]:
        """One denoising step of the whole batch (and the commit when every row's block is final): the events
        of blocks committed, and the batch (None when every request finished)."""
        with torch.inference_mode():
            return self._step(b, snapshots)

    def drop(self, b: DecodeBatch, indices: set[int]) -> DecodeBatch | None:
        """Remove the requests whose `Request.index` is in `indices` (cancelled), at any step."""
        keep = [r for r, s in enumerate(b.seqs) if s.index not in indices]
        if len(keep) == len(b.seqs):
            return b
        if not keep:
            return None
        self._keep_rows(b, keep)
        return b

    def _keep_rows(self, b: DecodeBatch, keep: list[int]) -> None:
        """Keep rows `keep` of every per-row part of the batch (requests that finished or were cancelled leave)."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        b.seqs = [b.seqs[r] for r in keep]
        b.cache.select(idx)
        if isinstance(b, ExactBatch):
            b.decided, b.n_decided = b.decided[idx], b.n_decided[idx]
            b.drafts, b.n_drafts = b.drafts[idx], b.n_drafts[idx]
            return
        b.sampler.select(keep)
        b.block, b.steps, b.limit, b.logits = b.block[idx], b.steps[idx], b.limit[idx], b.logits[idx]
        b.forwards = b.forwards[idx]
        if b.needed is not None:
            b.needed = b.needed[idx]

    def _banned(self) -> list[int]:
        return [self.mask_id] + list(range(self.vocab_limit, self.vocab_size))

    # -- the block loop -------------------------------------------------------------------------------
    def _needed(self, block: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
        """`[N, B]`: masked positions that can still count — before the row's `limit` (a block cut by
        `max_new_tokens`) and before the first decided EOS (what follows an EOS is dropped). Only these are
        candidates for a step, so no step is ever spent on a token that would be thrown away."""
        masked = block == self.mask_id
        need = limit
        if self.eos_ids:
            eos = torch.isin(block, self._eos) & ~masked
            need = torch.where(eos.any(1), torch.minimum(eos.int().argmax(1) + 1, limit), need)
        return masked & (self._positions[None] < need[:, None])

    def _step(self, b: DecodeBatch, snapshots: bool) -> tuple[list[Event], DecodeBatch | None]:
        """One denoising step for every row that needs one, then the forward that feeds the next step."""
        if isinstance(b, ExactBatch):
            return self._exact_step(b)
        logits = b.logits.clone()  # the sampler consumes its input
        # the previous step's check of what is still needed is this step's candidates: one `_needed` per step
        candidates = b.needed if b.needed is not None else self._needed(b.block, b.limit)
        active = candidates.any(1)  # rows whose block is final sit this step out
        tokens, confidence = b.sampler(logits, active)
        accept = self.rule.select(tokens, confidence, candidates)
        b.block = torch.where(accept, tokens, b.block)
        b.sampler.observe_block(tokens, accept)
        b.steps += active
        b.step_index += 1
        self.counters.steps += 1
        events: list[Event] = self._snapshots(b, accept, active) if snapshots else []
        self._stop_early(b, active)

        b.needed = self._needed(b.block, b.limit)
        if bool(b.needed.any()):
            # query output p - 1 predicts position p: recompute it only where p is still needed. Position 0's
            # prediction comes from the committed tokens and stays valid, so it alone needs no forward.
            wanted = b.needed[:, 1:]
            if bool(wanted.any()):
                at = torch.cat([wanted, torch.zeros_like(wanted[:, :1])], dim=1)
                b.logits[:, 1:][wanted] = self._forward(None, b.cache, query_ids=b.block, logits_at=at)
                b.forwards += wanted.any(1)  # a row whose block is final (or needs only position 0) was not fed
            return events, b
        events += self._finish_block(b)
        if not b.seqs:
            return events, None
        self._commit(b)
        return events, b

    def _stop_early(self, b: BlockBatch, active: torch.Tensor) -> None:
        """A row whose block's decided prefix completes a stop string is final now: its `limit` becomes the
        prefix's length up to the token that completes the string, so no step is spent after it. The output is
        the same as checking the finished block (the prefix never changes); only rows with stop strings that took
        this step decode any text."""
        rows = [r for r, s in enumerate(b.seqs) if s.params.stop]
        if not rows or self.detokenize is None:
            return
        act, block, limit = active.tolist(), b.block.tolist(), b.limit.tolist()
        for r in rows:
            if not act[r]:
                continue
            prefix = block[r][: limit[r]]
            if self.mask_id in prefix:
                prefix = prefix[: prefix.index(self.mask_id)]
            cut = b.seqs[r].stop_cut(prefix, self.eos_ids, self.detokenize)
            if cut is not None:
                b.limit[r] = cut

    def _snapshots(self, b: BlockBatch, accept: torch.Tensor, active: torch.Tensor) -> list[Event]:
        block, new, act = b.block.tolist(), accept.tolist(), active.tolist()
        return [StepSnapshot(s.index, len(s.steps_per_block), int(b.steps[r]),
                             [None if t == self.mask_id else t for t in block[r]], new[r])
                for r, s in enumerate(b.seqs) if act[r]]

    def _finish_block(self, b: BlockBatch) -> list[Event]:
        """Every row's block is final: apply EOS / stop / length, emit the pieces, drop finished rows."""
        now = time.perf_counter()
        rows, steps, limits, forwards = b.block.tolist(), b.steps.tolist(), b.limit.tolist(), b.forwards.tolist()
        events: list[Event] = []
        keep = []
        for r, seq in enumerate(b.seqs):
            events.append(self._emit(seq, rows[r][: limits[r]], steps[r], forwards[r], now))
            if not seq.finished:
                keep.append(r)
        if not keep:
            b.seqs = []
        elif len(keep) < len(b.seqs):
            self._keep_rows(b, keep)
        return events

    def _emit(self, seq: Request, block: list[int], steps: int, forwards: int, now: float) -> StreamPiece:
        """`seq` takes its finished block (EOS / stop / length applied there); the piece a client streams."""
        piece = seq.append_block(block, steps, forwards, self.eos_ids, self.detokenize, now)
        return StreamPiece(seq.index, piece, len(seq.steps_per_block) - 1, seq.finished, seq.finish_reason,
                           seq.stats() if seq.finished else None)

    def _commit(self, b: BlockBatch) -> None:
        """The finished block joins the cache, in the same forward as the next block's first step."""
        n = len(b.seqs)
        b.limit = self._limits(b.seqs)
        b.logits = self._open_block(b.block, b.cache, b.limit, prefix_len=self.block_size if self.causal_context else 0)
        b.block = self._masks(n)
        b.steps = torch.zeros(n, dtype=torch.long, device=self.device)
        b.forwards = b.steps + 1  # this forward feeds the new block's first step
        b.step_index = 0
        b.needed = None
