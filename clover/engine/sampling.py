"""Sampling: per-request `SamplingParams`, and logits -> (candidate token, confidence) for a whole batch of blocks.

A denoising step does not sample one token per sequence; it proposes a candidate for *every* position of the
block and scores it, and an unmasking rule (`clover.engine.decoding`) decides which candidates to keep. So the
sampler returns, for logits `[N, B, V]`:

* `tokens` `[N, B]`: the candidate at each position — argmax (greedy, `temperature == 0`) or a sample from the
  transformed distribution;
* `confidence` `[N, B]`: the probability of that candidate under the model's distribution — softmax of the
  logits after the banned ids and the repetition penalty, **before** temperature, top-k and top-p. Those three
  only shape how a token is drawn; the threshold asks how sure the model is of the token the step would commit,
  so it reads that token's own probability, as Fast-dLLM does. The tempered maximum would say something else:
  at temperature 0.5 a token at 0.7 (against one at 0.3) reads 0.84, and it is the likeliest token's, not the
  drawn one's. For greedy rows the candidate is the argmax, so it is the maximum probability, as before.

Transforms, in order: banned ids (the mask token, ids the tokenizer cannot decode) -> repetition penalty (CTRL /
`transformers` form over the prompt and every generated token, the block's already-decided tokens included)
-> temperature -> top-k -> top-p. Greedy rows skip temperature/top-k/top-p (they would not change the argmax and
would only inflate its confidence). Everything is vectorised over the batch and block; the only per-row Python is
drawing each sampled row's noise from its own seeded generator, which keeps a request's random stream the same
whether it runs alone or in a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens (independent of the unmasking rule and the engine)."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    seed: int | None = None  # per-request generator; None: drawn from torch's global RNG
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings (need a detokenizer in the engine)
    # a `clover.engine.grammar.Grammar` the output must follow (exact mode); None: free text
    grammar: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator | None:
        if self.greedy:
            return None
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


class BatchSampler:
    """The sampling transforms of a batch of requests, as tensors, so a step costs a handful of kernels.

    `banned` ids are never proposed. `select(rows)` follows the engine when finished requests leave the batch.
    """

    def __init__(self, params: Sequence[SamplingParams], vocab_size: int, banned: Sequence[int],
                 device: torch.device | str = "cpu") -> None:
        self.params = list(params)
        self.generators = [p.make_generator(device) for p in self.params]
        n = len(self.params)
        self.temperature = torch.tensor([p.temperature for p in self.params], device=device)
        self.top_p = torch.tensor([p.top_p for p in self.params], device=device)
        self.top_k = torch.tensor([p.top_k for p in self.params], dtype=torch.long, device=device)
        self.penalty = torch.tensor([p.repetition_penalty for p in self.params], device=device)
        self.banned_ids = torch.as_tensor(list(banned), dtype=torch.long, device=device)
        # tokens seen so far per row (prompt + generated), for the repetition penalty; only kept when used
        self.presence = torch.zeros(n, vocab_size, dtype=torch.bool, device=device) if self.uses_penalty else None
        self._update_flags()

    @property
    def uses_penalty(self) -> bool:
        return any(p.repetition_penalty != 1.0 for p in self.params)

    def _update_flags(self) -> None:
        self.greedy_rows = [p.greedy for p in self.params]
        self.greedy_mask = torch.tensor(self.greedy_rows, device=self.temperature.device)  # built once, not per step
        self.all_greedy = all(self.greedy_rows)
        self.filtering = any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in self.params)

    def select(self, rows: Sequence[int]) -> None:
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.temperature.device)
        self.params = [self.params[i] for i in rows]
        self.generators = [self.generators[i] for i in rows]
        self.temperature, self.top_p = self.temperature[idx], self.top_p[idx]
        self.top_k, self.penalty = self.top_k[idx], self.penalty[idx]
        if self.presence is not None:
            self.presence = self.presence[idx]
        self._update_flags()

    @classmethod
    def concat(cls, samplers: Sequence["BatchSampler"]) -> "BatchSampler":
        """The rows of several samplers in one (a request joins a running batch). Generators are moved, not
        copied, so each request's random stream continues where it was."""
        new = cls.__new__(cls)
        new.params = [p for s in samplers for p in s.params]
        new.generators = [g for s in samplers for g in s.generators]
        new.temperature = torch.cat([s.temperature for s in samplers])
        new.top_p = torch.cat([s.top_p for s in samplers])
        new.top_k = torch.cat([s.top_k for s in samplers])
        new.penalty = torch.cat([s.penalty for s in samplers])
        new.banned_ids = samplers[0].banned_ids
        if any(s.presence is not None for s in samplers):  # rows without a penalty never read theirs
            vocab = next(s.presence.shape[1] for s in samplers if s.presence is not None)
            device = new.temperature.device
            new.presence = torch.cat([s.presence if s.presence is not None else
                                      torch.zeros(len(s.params), vocab, dtype=torch.bool, device=device)
                                      for s in samplers])
        else:
            new.presence = None
        new._update_flags()
        return new

    def observe(self, row_tokens: Sequence[Sequence[int]]) -> None:
        """Mark prompt tokens as seen (repetition penalty)."""
        if self.presence is None:
            return
        for row, toks in enumerate(row_tokens):
            if len(toks):
                self.presence[row, torch.as_tensor(list(toks), dtype=torch.long, device=self.presence.device)] = True

    def observe_block(self, tokens: torch.Tensor, accepted: torch.Tensor) -> None:
        """Mark newly accepted tokens `tokens[accepted]` (`[N, B]`) as seen."""
        if self.presence is None:
            return
        rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None].expand_as(tokens)
        self.presence[rows[accepted], tokens[accepted]] = True

    def __call__(self, logits: torch.Tensor, active: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`logits` `[N, B, V]` -> candidate `tokens` `[N, B]` and `confidence` `[N, B]` (fp32).

        `logits` is consumed: when already fp32 it is modified in place (banned ids set to -inf), which saves a
        copy of the largest tensor of the step.

        `active` `[N]` (bool): rows that take this step; only they draw noise from their generator, so a request's
        random stream does not depend on what else is in the batch.
        """
        x = self.model_logits(logits)
        if self.all_greedy:  # max prob = exp(max logit - logsumexp): two passes, no probability tensor
            best, tokens = x.max(dim=-1)
            return tokens, torch.exp(best - torch.logsumexp(x, dim=-1))

        probs = self.draw_probs(x)
        tokens = probs.argmax(dim=-1)
        for row, gen in enumerate(self.generators):
            if gen is None or (active is not None and not bool(active[row])):
                continue
            tokens[row] = self.draw(probs[row], gen)
        chosen = x.gather(-1, tokens[..., None])[..., 0]
        return tokens, torch.exp(chosen - torch.logsumexp(x, dim=-1))

    def model_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` `[N, B, V]` -> the model's distribution as fp32 logits: banned ids, then the repetition
        penalty (the confidence reads it). Consumes `logits` as `__call__` does."""
        x = logits.float()
        x[..., self.banned_ids] = float("-inf")  # in place: the caller hands over a fresh tensor
        if self.presence is not None:
            pen = torch.where(self.presence, self.penalty[:, None], torch.ones_like(self.penalty)[:, None])[:, None]
            x = torch.where(x > 0, x / pen, x * pen)
        return x

    def draw_probs(self, x: torch.Tensor) -> torch.Tensor:
        """`model_logits` `[N, B, V]` -> the distribution a sampled row draws from: temperature, top-k, top-p,
        softmax. Greedy rows get the untempered, unfiltered softmax (its argmax is theirs). A new tensor."""
        greedy = self.greedy_mask
        temp = torch.where(greedy, torch.ones_like(self.temperature), self.temperature)
        x = x / temp[:, None, None]
        if self.filtering:
            x = self._filter(x, greedy)
        return torch.softmax(x, dim=-1)

    @staticmethod
    def draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """One token per distribution in `probs` `[..., V]` (need not be normalised), from `gen`: the exponential
        race, argmax(p / E) with E ~ Exp(1), is a draw from p (one kernel, no cumsum)."""
        noise = torch.empty_like(probs).exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)

    def _filter(self, x: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
        """Per-row top-k then top-p (nucleus) on `[N, B, V]` scaled logits; greedy rows untouched."""
        v = x.shape[-1]
        sorted_x, order = x.sort(dim=-1, descending=True)
        rank = torch.arange(v, device=x.device)
        k = torch.where((self.top_k > 0) & ~greedy, self.top_k, torch.full_like(self.top_k, v))
        drop = rank[None, None, :] >= k[:, None, None]
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_x, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly before each rank; the top token always survives
        top_p = torch.where(greedy, torch.ones_like(self.top_p), self.top_p)[:, None, None]
        sorted_x = sorted_x.masked_fill((before >= top_p) & (top_p < 1.0), float("-inf"))
        return torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
