"""The engine: requests in, pieces of text out — validation, prefill, continuous batching, emission.

What happens between a prompt's prefill and its last token is a decoding loop (clover.engine.loops.loop), chosen once
from the rule: `BlockLoop` (block_loop.py) denoises blocks with an unmasking rule, `ExactLoop` (exact.py) verifies
drafts against the causal path. The engine drives whichever it was given and never asks which:

    run(prompts)          validate -> prefill -> loop.step until every request finished
    prefill               prompts left-padded, read causally in chunks of `prefill_chunk` (prefill.py, shared
                          with decision mode); the last chunk is the loop's `open` (it carries the loop's first
                          query block)
    emit                  a request takes its committed tokens (EOS / stop / length applied there), finished
                          requests leave the batch

Continuous batching (the server's scheduler) uses the same loop one request at a time: `begin_prefill` +
`prefill_step` prefill a request alone, chunk by chunk on the absolute grid of `prefill_chunk` (optionally from a
cache that already holds a prefix of its prompt: prefix reuse), or `prefill_together` several short prompts in one
forward; `join` adds them to a running batch at a boundary of the loop, `step` advances the batch by one step, and
`drop` removes cancelled requests at any step.

The network runs behind `clover.engine.runner` (the torch model, or llama.cpp for a GGUF): `forward` is the one
call into it.
"""

from __future__ import annotations

import contextlib
import numbers
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence as Seq

import torch

from clover.config import check_threshold
from clover.engine.loops.block_loop import BlockBatch, BlockLoop
from clover.engine.drafts.cost import ForwardCost
from clover.engine.decoding import ExactRule, UnmaskingRule, make_rule
from clover.engine.drafts.draft_memory import DraftMemory
from clover.engine.loops.exact import ExactBatch, ExactLoop
from clover.engine.logprobs import TokenLogprob, banned_ids
from clover.engine.loops.loop import EngineCounters, Event, StreamPiece
from clover.engine.prefill import DEFAULT_PREFILL_CHUNK, EXPECTED_ANSWER, grid_chunk, prefill
from clover.engine.constraints.repetition import BreakerCache
from clover.engine.request import Detokenize, Options, RequestOptions, Sequence, as_options
from clover.engine.runner import ModelRunner, RunnerCache, as_runner, release_cache
from clover.engine.sampling import SamplingParams


DecodeBatch = BlockBatch | ExactBatch  # the running batch, opaque outside the engine (the scheduler holds it)


@dataclass
class Prefill:
    """A request being prefilled on its own, one chunk per `Engine.prefill_step`, before it joins a batch."""

    seq: Sequence
    cache: RunnerCache  # one row; holds `done` prompt tokens
    done: int = 0
    pad: int = 0  # columns of padding before the prompt: a prompt read on a block grid starts a whole block


class Engine:
    """Decodes batches of prompts with one model, block size and rule (defaults: the model config's).

    `vocab_limit`: ids >= it are never emitted (a padded embedding matrix larger than the tokenizer);
    `detokenize`: ids -> text, needed for stop strings and DRY's sequence breakers (`token_texts`, every id's text
    at once, reads those faster); `prefill_chunk`: prompt tokens per prefill forward,
    which bounds the prefill's activation memory for long prompts; `cost`: exact mode's forward cost table
    (`clover.engine.drafts.cost`; measured on first use when None); `draft_memory`: the answers exact mode drafts from
    (clover.engine.drafts.draft_memory; a new one when None, unless the rule's `memory` option is off), which every
    request this engine makes joins when it finishes (a server may give a request another: one per API key).
    """

    def __init__(self, model: torch.nn.Module | ModelRunner, block_size: int | None = None,
                 threshold: float | None = None, rule: str | UnmaskingRule | ExactRule | None = None,
                 rule_options: dict[str, Any] | None = None, *,
                 eos_token_ids: Seq[int] | None = None, vocab_limit: int | None = None,
                 detokenize: Detokenize | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 cost: ForwardCost | None = None, token_texts: Callable[[], Seq[str]] | None = None,
                 draft_memory: DraftMemory | None = None) -> None:
        self.runner = as_runner(model)
        config = self.runner.config
        self.block_size = config.block_size if block_size is None else int(block_size)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        limit = self.runner.max_block_size
        if limit is not None and self.block_size > limit:
            raise ValueError(f"block_size={self.block_size}: the {self.runner.name} runner decodes blocks of at most "
                             f"{limit} tokens (its max_block_size)")
        # checked here too: a rule without a threshold (exact) would pass any on to the requests
        self.threshold = check_threshold(config.threshold if threshold is None else threshold)
        self.rule = make_rule(config.rule if rule is None else rule, threshold=self.threshold, **(rule_options or {}))
        if getattr(self.runner, "causal_only", False) and self.block_size > 1 and not isinstance(self.rule, ExactRule):
            raise ValueError(f"rule {self.rule.name!r} with block_size={self.block_size}: the {self.runner.name} "
                             "runner runs this model's causal path only (a hybrid model's Gated DeltaNet on llama.cpp "
                             "is causal, and a block rule reads each block in both directions); use block_size=1 or "
                             "rule 'exact', or the torch runner")
        if config.mask_token_id is None:
            raise ValueError("the model's config has no mask_token_id; block decoding needs one "
                             "(`clover convert` adds it)")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.mask_id = config.mask_token_id
        # committed blocks read causally (each token its own block) instead of bidirectionally inside the block
        self.causal_context = config.context_reading == "causal"
        self.eos_ids = list(config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.vocab_size = config.vocab_size
        self.vocab_limit = self.vocab_size if vocab_limit is None else min(int(vocab_limit), self.vocab_size)
        self.detokenize = detokenize
        self.breakers = (BreakerCache(self.vocab_size, self.vocab_limit, detokenize, token_texts)
                         if detokenize is not None or token_texts is not None else None)
        self.prefill_chunk = prefill_chunk
        self.device = self.runner.device
        self.eos = torch.tensor(self.eos_ids, dtype=torch.long, device=self.device)
        self.banned_ids = torch.tensor(self._banned(), dtype=torch.long, device=self.device)
        self.counters = EngineCounters()
        self.loop = ExactLoop(self, self.rule, cost) if isinstance(self.rule, ExactRule) else BlockLoop(self, self.rule)
        uses_memory = isinstance(self.rule, ExactRule) and self.rule.lookup and self.rule.memory
        self.memory = (draft_memory if draft_memory is not None else DraftMemory()) if uses_memory else None
        # the block grid prompts are read on (1: causally); the loop decides (exact mode is block-size-1 decoding)
        self.prompt_grid = self.loop.prompt_grid

    def settings(self) -> dict[str, Any]:
        """The decoding settings this engine runs with (what `--json` and the server report)."""
        settings = {"block_size": self.block_size, "rule": self.rule.name, "loop": self.loop.name}
        if "threshold" in getattr(self.rule, "__dataclass_fields__", {}):
            settings["threshold"] = self.rule.threshold
        return settings | self.loop.figures()

    # -- public ---------------------------------------------------------------------------------------
    def run(self, prompts: Seq[Seq[int]], max_new_tokens: int, options: Options | Seq[Options],
            snapshots: bool = False) -> Iterator[Event]:
        """Decode `prompts` together; yield a `StreamPiece` per request per block (and `StepSnapshot`s). Requests
        that name no drafting memory draft from (and join) the engine's own (`draft_memory`).

        Inputs are validated here, before the first `next()`, so a bad request fails where it is made."""
        given = [as_options(o) for o in self._per_prompt(options, len(prompts))]
        own = [o if o.memory is not None else replace(o, memory=self.memory) for o in given]
        return self._run(self.make_sequences(prompts, max_new_tokens, own), snapshots)

    def _run(self, seqs: list[Sequence], snapshots: bool) -> Iterator[Event]:
        with self._decoding():
            batch = self._prefill(seqs)
        while batch is not None:
            with self._decoding():  # not around the yield: the caller's code must not run in this mode
                events, batch = self.loop.step(batch, snapshots)
            yield from events
        self.loop.idle()  # after the last answer's tokens went out

    # -- setup ----------------------------------------------------------------------------------------
    def make_sequences(self, prompts: Seq[Seq[int]], max_new_tokens: int, options: Options | Seq[Options], *,
                       ids: Seq[int] | None = None) -> list[Sequence]:
        """Validated requests (`ValueError` naming the parameter otherwise), timed from now, one per prompt with
        its `options` (one for all, or one each; bare `SamplingParams` ask nothing else): rows of one batch may
        differ in any of them (a block rule reads each row's threshold; EOS ends only rows that heed it). A
        sampled request that gave no seed gets one now, which its sequence carries (a record reproduces it).
        `ids`: the sequences' `seq_id`s, what their events carry (None: their positions in `prompts`)."""
        if len(prompts) == 0:
            raise ValueError("prompts is empty: give at least one prompt")
        ids = range(len(prompts)) if ids is None else list(ids)
        if len(ids) != len(prompts):
            raise ValueError(f"got {len(ids)} ids for {len(prompts)} prompts")
        opts = [as_options(o).resolved() for o in self._per_prompt(options, len(prompts))]
        if self.memory is None:  # a drafting memory only where this engine drafts from one
            opts = [o if o.memory is None else replace(o, memory=None) for o in opts]
        if not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if self.detokenize is None and any(o.stop for o in opts):
            raise ValueError("stop strings need a detokenizer: pass detokenize=tokenizer.decode")
        if self.breakers is None and any(o.sampling.uses_dry and o.sampling.dry_sequence_breakers for o in opts):
            raise ValueError("DRY sequence breakers need the vocabulary's texts: pass detokenize=tokenizer.decode "
                             "(or dry_sequence_breakers=())")
        self.loop.check(opts)
        prompts = [list(map(int, p)) for p in prompts]
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
            bad = [t for t in p if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size}): {bad[:5]}")
        limit = self.runner.max_context
        longest = max(len(p) for p in prompts)
        source = ("the model's max_position_embeddings" if limit == self.runner.config.max_position_embeddings
                  else "its KV cache; --ctx sets it")
        where = f"the {self.runner.name} runner's context of {limit} positions ({source})"
        if longest >= limit:
            raise ValueError(f"a prompt of {longest} tokens leaves no room for max_new_tokens within {where}")
        room, unit = self.loop.room(limit, longest, self.block_size)
        if max_new_tokens > room:
            raise ValueError(
                f"max_new_tokens={max_new_tokens} is too large: the prompt has {longest} tokens and generation "
                f"needs its positions in {unit}, within {where}; at most "
                f"{max(room, 0)} new tokens fit")
        now = time.perf_counter()
        return [Sequence(ids[i], p, o, int(max_new_tokens), start_time=now,
                         matcher=o.grammar.matcher(self.vocab_size, [] if o.ignore_eos else self.eos_ids,
                                                   self.runner.config.eos_token_ids)
                         if o.grammar is not None else None,
                         budget=o.thinking_budget.tracker(p, self.vocab_size, [] if o.ignore_eos else self.eos_ids)
                         if o.thinking_budget is not None else None) for i, (p, o) in enumerate(zip(prompts, opts))]

    @staticmethod
    def _per_prompt(options: Options | Seq[Options], n: int) -> list[Options]:
        """One options object per prompt: `options` for each, or the list given (its length checked)."""
        if isinstance(options, (RequestOptions, SamplingParams)):
            return [options] * n
        options = list(options)
        if len(options) != n:
            raise ValueError(f"got {len(options)} options for {n} prompts")
        return options

    def eos_of(self, seq: Sequence) -> list[int]:
        """The ids that end `seq`: its grammar's (the model's, under ignore_eos: clover.engine.constraints.grammar),
        none under `ignore_eos`, else the engine's."""
        if seq.matcher is not None:
            return seq.matcher.eos_ids
        return [] if seq.options.ignore_eos else self.eos_ids

    def heeds_eos(self, seqs: Seq[Sequence]) -> torch.Tensor | None:
        """`[N]` bool: the rows an engine EOS ends (None when all do, the common case: no tensor built)."""
        if not any(s.options.ignore_eos for s in seqs):
            return None
        return torch.tensor([not s.options.ignore_eos for s in seqs], dtype=torch.bool, device=self.device)

    # -- what the loops share -----------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor | None, cache: RunnerCache, block_size: int | None = None,
                **kwargs: Any) -> torch.Tensor:
        """The runner's logits for one forward (`clover.engine.runner`), timed and counted."""
        start = time.perf_counter()
        out = self.runner.forward(ids, block_size or self.block_size, cache=cache, **kwargs)
        self.counters.forward_time_s += time.perf_counter() - start
        self.counters.forwards += 1
        return out

    def masks(self, n: int, width: int | None = None) -> torch.Tensor:
        return torch.full((n, width or self.block_size), self.mask_id, dtype=torch.long, device=self.device)

    def emit(self, b: DecodeBatch, pieces: list[tuple[list[int], int, int]],
             logprobs: Seq[Seq[TokenLogprob | None] | None] | None = None) -> list[Event]:
        """Row `r` of `b` takes `pieces[r]` = (its committed tokens, cut to what it may still produce; the steps
        they took; the forwards that fed them): EOS / stop / length are applied by the request, and finished
        requests leave the batch. The events a client streams. `logprobs[r]`: one per token of `pieces[r]`, for
        the rows that asked for them (None elsewhere); the piece that counts takes its first ones."""
        now = time.perf_counter()
        events: list[Event] = []
        keep = []
        for r, (seq, (tokens, steps, forwards)) in enumerate(zip(b.seqs, pieces)):
            piece = seq.append_block(tokens, steps, forwards, self.eos_of(seq), self.detokenize, now)
            values = logprobs[r] if logprobs is not None else None
            events.append(StreamPiece(seq.seq_id, piece, len(seq.steps_per_block) - 1, seq.finished,
                                      seq.finish_reason, seq.stats() if seq.finished else None,
                                      list(values[:len(piece)]) if values is not None else None))
            if not seq.finished:
                keep.append(r)
            elif seq.options.memory is not None:
                seq.options.memory.add(seq.generated)
        if not keep:
            b.seqs = []
            release_cache(b.cache)  # the batch ends here (its loop returns None): llama.cpp's slots come back now
        elif len(keep) < len(b.seqs):
            self.loop.keep_rows(b, keep)
        return events

    def _banned(self) -> list[int]:
        return banned_ids(self.mask_id, self.vocab_limit, self.vocab_size)

    # -- prefill --------------------------------------------------------------------------------------
    def _prefill(self, seqs: list[Sequence]) -> DecodeBatch:
        """Prompts, left-padded, read causally in chunks of `prefill_chunk` (`clover.engine.prefill`); the last
        chunk opens the loop."""
        self.loop.calibrate(defer=True)  # a first answer does not wait for a measurement (`DecodingLoop.idle`)
        cache = self.runner.new_cache(len(seqs))
        last = prefill([self.loop.prefilled(s.prompt) for s in seqs], self.mask_id, self.prefill_chunk,
                       lambda ids, **kwargs: self.forward(ids, cache, **kwargs), self.device, self.prompt_grid)
        for s in seqs:
            s.prefill_forwards = last.forwards
        return self.loop.open(seqs, last.ids, cache, prompt=True, **last.kwargs)

    # -- continuous batching: one request at a time -------------------------------------------------------
    def prefill_together(self, seqs: list[Sequence]) -> DecodeBatch:
        """Prefill `seqs` in one batch (left-padded, as `run` does: each row gets what it gets alone), ready to
        join a running one. For prompts of at most `prefill_chunk` tokens this is one forward for all of them,
        where `prefill_step` takes one each: a forward of a few dozen rows leaves most of a CPU's arithmetic
        unused."""
        with self._decoding():
            return self._prefill(seqs)

    def begin_prefill(self, seq: Sequence, cache: RunnerCache | None = None) -> Prefill:
        """Start prefilling `seq` alone. `cache` (one row) may already hold a prefix of its prompt (prefix reuse);
        it must end on the chunk grid and leave at least one prompt token, whose logits start decoding."""
        if cache is not None and self.prompt_grid > 1:
            raise ValueError("a prompt read on a block grid (prompt_reading 'blocks') is left-padded to whole blocks, "
                             "so a prefix cached for another prompt does not line up: prefill it whole")
        self.loop.calibrate()
        cache = cache if cache is not None else self.runner.new_cache(1)
        if hasattr(cache, "expect"):  # its KV allocated once at about its final size (clover.model.cache)
            cache.expect(len(seq.prompt) + min(seq.max_new_tokens, EXPECTED_ANSWER) + self.block_size)
        done = cache.length
        if cache.batch_size != 1 or done % self.prefill_chunk or done >= len(seq.prompt):
            raise ValueError(f"a reused prefix must be one row ending on the {self.prefill_chunk}-token grid before "
                             f"the prompt's end; got {cache.batch_size} rows, {done} of {len(seq.prompt)} tokens")
        seq.prefill_forwards = 0
        return Prefill(seq, cache, done, pad=-len(self.loop.prefilled(seq.prompt)) % self.prompt_grid)

    def prefill_step(self, p: Prefill) -> DecodeBatch | None:
        """One prefill chunk, ending on the absolute grid of `prefill_chunk` tokens — so a prefill resumed from a
        reused prefix runs exactly the forwards of a cold one, and gives the same bits. The last chunk opens the
        loop (as `_prefill` does) and returns the request as a one-row batch; earlier ones return None."""
        grid = self.prompt_grid
        # padding (invalid) to whole blocks on a block grid
        prompt = [self.mask_id] * p.pad + self.loop.prefilled(p.seq.prompt)
        chunk = grid_chunk(self.prefill_chunk, grid)
        end = min((p.done // chunk + 1) * chunk, len(prompt))
        ids = torch.tensor([prompt[p.done:end]], dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = {"prefix_len": end - p.done if grid == 1 else 0}
        if p.done < p.pad:
            kwargs["attention_mask"] = torch.arange(p.done, end, device=self.device)[None] >= p.pad
        p.seq.prefill_forwards += 1
        with self._decoding():
            if end < len(prompt):
                self.forward(ids, p.cache, logits_to_keep=0, prompt=True, **kwargs)
                opened = None
            else:
                opened = self.loop.open([p.seq], ids, p.cache, prompt=True, **kwargs)
        p.done = end
        return opened

    def at_block_boundary(self, b: DecodeBatch) -> bool:
        """Whether rows can join `b` now (no step of the current block taken; in exact mode, always)."""
        return self.loop.at_boundary(b)

    def join(self, b: DecodeBatch | None, new: DecodeBatch) -> DecodeBatch:
        """`new` (prefilled, at the start of its first block) joins the running batch `b` at a block boundary.
        Each row keeps exactly what it would get alone: its cache rows, logits and random stream are its own."""
        if b is None:
            return new
        if not (self.at_block_boundary(b) and self.at_block_boundary(new)):
            raise ValueError("requests join a batch only at a block boundary")
        return self.loop.join(b, new)

    def step(self, b: DecodeBatch, snapshots: bool = False) -> tuple[list[Event], DecodeBatch | None]:
        """One step of the whole batch: the events of what was committed, and the batch (None when every
        request finished)."""
        with self._decoding():
            return self.loop.step(b, snapshots)

    @contextlib.contextmanager
    def _decoding(self) -> Iterator[None]:
        """What the engine's prefills and steps run under: inference mode, and torch's intra-op threads set to the
        runner's `torch_threads` where it names them (a runner whose forwards run on threads of their own, llama.cpp's:
        torch's ops between its forwards read a few rows of logits, and torch's pool, once woken, would spin on the
        cores those threads decode on); the caller's setting back after."""
        want, before = getattr(self.runner, "torch_threads", None), torch.get_num_threads()
        if want is not None and want != before:
            torch.set_num_threads(want)
        try:
            with torch.inference_mode():
                yield
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)

    def drop(self, b: DecodeBatch, indices: set[int]) -> DecodeBatch | None:
        """Remove the requests whose `Sequence.seq_id` is in `indices` (cancelled), at any step."""
        keep = [r for r, s in enumerate(b.seqs) if s.seq_id not in indices]
        if len(keep) == len(b.seqs):
            return b
        if not keep:
            release_cache(b.cache)
            return None
        self.loop.keep_rows(b, keep)
        return b
