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
-> DRY (llama.cpp's "don't repeat yourself", clover.engine.constraints.repetition) -> temperature -> top-k -> top-p.

Histories per position. The repetition penalty and DRY read the tokens before the position they judge. A caller
gives each row an `extension` (first position, tokens): position `first + j` reads the row's history (prompt and
committed tokens, `observe`) followed by `tokens[:j]`, for `j = 0 .. len(tokens)` — exact mode's drafts (position
`j` is only used if drafts `1..j` are accepted, so it is judged as block size 1 would judge it after them), a
block's decided prefix. DRY leaves other positions alone (the tokens just before them are not known yet); the
repetition penalty reads the history there, plus what `observe_block` marked.

Greedy rows skip temperature/top-k/top-p (they would not change the argmax and would only inflate its confidence).
Everything is vectorised over the batch and block but DRY's match search (a few tensor operations per judged
position of a row that uses it). A sampled position draws with noise keyed by the request's seed, its answer
position and the step (clover.engine.noise), not from a stream consumed draw by draw: a request's tokens are the
same alone or in a batch, whatever the steps or drafts around them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from clover.engine.noise import fresh_seed, noise_key, race
from clover.engine.constraints.repetition import (DEFAULT_BREAKERS, Breakers, DryConfig, LagMatches, dry_candidates,
                                                  penalty_of)

Extension = Sequence[tuple[int, Sequence[int]]]  # per row: (first position, tokens after the history)


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens: the transforms of its logits and the seed its draws are keyed by
    (independent of the unmasking rule and the engine; the rest of what a request asks is its
    `clover.engine.request.RequestOptions`)."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    # DRY, llama.cpp's names and defaults (docs/decoding.md "Repetition"): multiplier 0 is off
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # -1: the whole history (prompt and output)
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_BREAKERS
    # whether repeats of the prompt count (llama.cpp's and text-generation-webui's DRY: yes); False: DRY's history
    # is the answer alone, so copying a name or number from the prompt costs nothing
    dry_include_prompt: bool = True
    seed: int | None = None  # keys the noise of every sampled token with its position (clover.engine.noise);
    # None: a fresh random seed per request (drawn once: `resolved`)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        self._check_dry()

    def _check_dry(self) -> None:
        breakers = self.dry_sequence_breakers
        object.__setattr__(self, "dry_sequence_breakers", (breakers,) if isinstance(breakers, str) else tuple(breakers))
        if not self.dry_multiplier >= 0 or self.dry_multiplier == float("inf"):
            raise ValueError(f"dry_multiplier must be a finite number >= 0 (0 = off), got {self.dry_multiplier}")
        if not self.dry_base >= 1.0 or self.dry_base == float("inf"):
            raise ValueError(f"dry_base must be a finite number >= 1, got {self.dry_base}")
        if self.dry_allowed_length < 1:
            raise ValueError(f"dry_allowed_length must be >= 1, got {self.dry_allowed_length}")
        if self.dry_penalty_last_n < -1:
            raise ValueError(f"dry_penalty_last_n must be >= -1 (-1 = the whole history, 0 = off), "
                             f"got {self.dry_penalty_last_n}")
        if not isinstance(self.dry_include_prompt, bool):
            raise ValueError(f"dry_include_prompt must be a bool, got {self.dry_include_prompt!r}")
        if any(not isinstance(b, str) or not b for b in self.dry_sequence_breakers):
            raise ValueError(f"dry_sequence_breakers must be non-empty strings, got {list(self.dry_sequence_breakers)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def resolved(self) -> SamplingParams:
        """These parameters with the seed their noise is keyed by: a sampled request that gave none gets a fresh one
        now (unseeded requests differ from run to run), kept with the request so that a record of it reproduces
        its tokens; a greedy or seeded request is returned as it is."""
        if self.greedy or self.seed is not None:
            return self
        return replace(self, seed=fresh_seed())

    @property
    def uses_dry(self) -> bool:
        return self.dry_multiplier > 0 and self.dry_penalty_last_n != 0



class BatchSampler:
    """The sampling transforms of a batch of requests, as tensors, so a step costs a handful of kernels.

    `banned` ids are never proposed. `select(rows)` follows the engine when finished requests leave the batch.
    `breakers` resolves a request's DRY sequence breakers to token ids (the engine's, cached per vocabulary).
    """

    def __init__(self, params: Sequence[SamplingParams], vocab_size: int, banned: Sequence[int],
                 device: torch.device | str = "cpu",
                 breakers: Callable[[tuple[str, ...]], Breakers] | None = None) -> None:
        self.params = [p.resolved() for p in params]  # a sampled row draws with its own seed (drawn now if none)
        n = len(self.params)
        self.temperature = torch.tensor([p.temperature for p in self.params], device=device)
        self.top_p = torch.tensor([p.top_p for p in self.params], device=device)
        # a top_k beyond the vocabulary keeps every token: the same filter as vocab_size, and it fits an int64
        self.top_k = torch.tensor([min(p.top_k, vocab_size) for p in self.params], dtype=torch.long, device=device)
        self.penalty = torch.tensor([p.repetition_penalty for p in self.params], device=device)
        self.banned_ids = torch.as_tensor(list(banned), dtype=torch.long, device=device)
        # tokens seen so far per row (prompt + generated), for the repetition penalty; only kept when used
        self.presence = torch.zeros(n, vocab_size, dtype=torch.bool, device=device) if self.uses_penalty else None
        self.dry = [DryRow(p, breakers, device) if p.uses_dry else None for p in self.params]
        self._update_flags()

    @property
    def seeds(self) -> list[int | None]:
        """Per row: the seed its noise is keyed by (clover.engine.noise); None for greedy rows, which draw nothing."""
        return [None if p.greedy else p.seed for p in self.params]

    @property
    def uses_penalty(self) -> bool:
        return any(p.repetition_penalty != 1.0 for p in self.params)

    @property
    def uses_history(self) -> bool:
        """Whether some row's logits depend on the tokens before the position (repetition penalty, DRY)."""
        return self.presence is not None or any(d is not None for d in self.dry)

    def _update_flags(self) -> None:
        self.greedy_rows = [p.greedy for p in self.params]
        self.greedy_mask = torch.tensor(self.greedy_rows, device=self.temperature.device)  # built once, not per step
        self.all_greedy = all(self.greedy_rows)
        self.filtering = any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in self.params)

    def select(self, rows: Sequence[int]) -> None:
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.temperature.device)
        self.params = [self.params[i] for i in rows]
        self.temperature, self.top_p = self.temperature[idx], self.top_p[idx]
        self.top_k, self.penalty = self.top_k[idx], self.penalty[idx]
        self.dry = [self.dry[i] for i in rows]
        if self.presence is not None:
            self.presence = self.presence[idx]
        self._update_flags()

    @classmethod
    def concat(cls, samplers: Sequence["BatchSampler"]) -> "BatchSampler":
        """The rows of several samplers in one (a request joins a running batch), each with its own seed."""
        new = cls.__new__(cls)
        new.params = [p for s in samplers for p in s.params]
        new.temperature = torch.cat([s.temperature for s in samplers])
        new.top_p = torch.cat([s.top_p for s in samplers])
        new.top_k = torch.cat([s.top_k for s in samplers])
        new.penalty = torch.cat([s.penalty for s in samplers])
        new.banned_ids = samplers[0].banned_ids
        new.dry = [d for s in samplers for d in s.dry]
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
        """`row_tokens[r]` joined row `r`'s history (its prompt, then what it commits): the repetition penalty
        marks them seen, DRY appends them."""
        for row, toks in enumerate(row_tokens):
            if self.dry[row] is not None:  # an empty prompt too (a block grid's): DRY counts what comes after it
                self.dry[row].extend(toks)
            if self.presence is not None and len(toks):
                self.presence[row, torch.as_tensor(list(toks), dtype=torch.long, device=self.presence.device)] = True

    def observe_block(self, tokens: torch.Tensor, accepted: torch.Tensor) -> None:
        """Mark newly accepted tokens `tokens[accepted]` (`[N, B]`) as seen."""
        if self.presence is None:
            return
        rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None].expand_as(tokens)
        self.presence[rows[accepted], tokens[accepted]] = True

    def __call__(self, logits: torch.Tensor, draw: torch.Tensor | None = None, extension: Extension | None = None,
                 positions: Sequence[int] | None = None,
                 steps: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`logits` `[N, B, V]` -> candidate `tokens` `[N, B]` and `confidence` `[N, B]` (fp32).

        `logits` is consumed: when already fp32 it is modified in place (banned ids set to -inf), which saves a
        copy of the largest tensor of the step.

        `draw` `[N, B]` (bool): the positions whose candidate counts this step (None: all); a sampled row draws
        only there, elsewhere its candidate is the argmax. `positions` `[N]`: the answer position of each row's
        column 0 (column `c` is `positions[r] + c`; None: 0), `steps` `[N]`: the row's steps so far in this
        block (None: 0): with the row's seed they key the noise (clover.engine.noise), so a request's tokens do not
        depend on what else is in the batch or on how many draws came before. `extension`: per row, the tokens
        positions read after the history (module docstring).
        """
        x = self.model_logits(logits, extension)
        if self.all_greedy:  # max prob = exp(max logit - logsumexp): two passes, no probability tensor
            best, tokens = x.max(dim=-1)
            return tokens, torch.exp(best - torch.logsumexp(x, dim=-1))

        probs = self.draw_probs(x)
        tokens = probs.argmax(dim=-1)
        n, width = tokens.shape
        where = draw.tolist() if draw is not None else [[True] * width] * n
        first = list(positions) if positions is not None else [0] * n
        step = list(steps) if steps is not None else [0] * n
        picks = [(r, c) for r, seed in enumerate(self.seeds) if seed is not None for c in range(width) if where[r][c]]
        if picks:
            rows, cols = [r for r, _ in picks], [c for _, c in picks]
            tokens[rows, cols] = self.draw(probs[rows, cols], rows, [first[r] + c for r, c in picks],
                                           [step[r] for r in rows])
        chosen = x.gather(-1, tokens[..., None])[..., 0]
        return tokens, torch.exp(chosen - torch.logsumexp(x, dim=-1))

    def draw(self, probs: torch.Tensor, rows: Sequence[int], positions: Sequence[int],
             steps: Sequence[int] | None = None) -> torch.Tensor:
        """`[M]`: one token from each distribution of `probs` `[M, V]` (need not be normalised), the `j`-th with
        the noise of sampled row `rows[j]` at answer position `positions[j]` and step `steps[j]` (None: 0) — the
        exponential race, argmax(p / E) with E ~ Exp(1), a draw from p (clover.engine.noise)."""
        steps = steps if steps is not None else [0] * len(rows)
        seeds = self.seeds
        return race(probs, [noise_key(seeds[r], t, s) for r, t, s in zip(rows, positions, steps)])

    def model_logits(self, logits: torch.Tensor, extension: Extension | None = None) -> torch.Tensor:
        """`logits` `[N, B, V]` -> the model's distribution as fp32 logits: banned ids, then the repetition
        penalty and DRY (the confidence reads them), each position with its own history when `extension` gives
        one (module docstring). Consumes `logits` as `__call__` does."""
        x = logits.float()
        x[..., self.banned_ids] = float("-inf")  # in place: the caller hands over a fresh tensor
        if self.presence is not None:
            seen = self._seen(x.shape[1], extension)
            pen = torch.where(seen, self.penalty[:, None, None], torch.ones_like(self.penalty)[:, None, None])
            x = torch.where(x > 0, x / pen, x * pen)
        for row, dry in enumerate(self.dry):
            if dry is not None:
                first, tokens = extension[row] if extension is not None else (0, ())
                dry.penalise(x[row], first, tokens)
        return x

    def _seen(self, positions: int, extension: Extension | None) -> torch.Tensor:
        """`[N, T, V]` (or `[N, 1, V]`): the tokens each position's repetition penalty counts as seen."""
        if extension is None or not any(len(tokens) for _, tokens in extension):
            return self.presence[:, None]
        seen = self.presence[:, None].repeat(1, positions, 1)
        for row, (first, tokens) in enumerate(extension):
            for j, token in enumerate(tokens):  # seen from the position after it on
                seen[row, first + j + 1:, int(token)] = True
        return seen

    def draw_probs(self, x: torch.Tensor) -> torch.Tensor:
        """`model_logits` `[N, B, V]` -> the distribution a sampled row draws from: temperature, top-k, top-p,
        softmax. Greedy rows get the untempered, unfiltered softmax (its argmax is theirs). A new tensor."""
        greedy = self.greedy_mask
        temp = torch.where(greedy, torch.ones_like(self.temperature), self.temperature)
        x = x / temp[:, None, None]
        if self.filtering:
            x = self._filter(x, greedy)
        return torch.softmax(x, dim=-1)

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


class DryRow:
    """One request's DRY state: its config (breakers resolved) and the lag matches of its history
    (clover.engine.constraints.repetition), fed by `extend` (first the prompt, then what the request commits:
    BatchSampler. observe); `penalise` subtracts the penalty from a row's logits. Without `dry_include_prompt` the
    prompt is left out: the history is the answer alone."""

    def __init__(self, params: SamplingParams, breakers: Callable[[tuple[str, ...]], Breakers] | None,
                 device: torch.device | str) -> None:
        if breakers is None and params.dry_sequence_breakers:
            raise ValueError("DRY sequence breakers need the vocabulary's token texts: give the engine a detokenizer "
                             "(detokenize=tokenizer.decode), or dry_sequence_breakers=()")
        resolved = breakers(params.dry_sequence_breakers) if params.dry_sequence_breakers else None
        self.config = DryConfig(params.dry_multiplier, params.dry_base, params.dry_allowed_length,
                                params.dry_penalty_last_n, resolved or Breakers(torch.zeros(0, dtype=torch.bool)))
        self.single = self.config.breakers.single_ids()
        self.state = LagMatches([], self.config.window, device)
        self.history: list[int] = []  # the same tokens as a list (the breaker scan reads a few from the end)
        self.skip_prompt = not params.dry_include_prompt  # until the prompt has come (and gone)

    def extend(self, tokens: Sequence[int]) -> None:
        if self.skip_prompt:
            self.skip_prompt = False
            return
        tokens = [int(t) for t in tokens]
        if not len(self.state):  # a whole prompt: the Z-algorithm at once
            self.state = LagMatches(tokens, self.config.window, self.state.tokens.device)
        else:
            self.state.extend(tokens)
        self.history += tokens
        window = self.config.window
        if window and len(self.history) > 2 * window:  # keep the list bounded (the scan reads at most `window`)
            self.history = self.history[-window:]

    def penalise(self, x: torch.Tensor, first: int, tokens: Sequence[int]) -> None:
        """`x` `[T, V]` (one row's logits, in place): position `first + j` loses the DRY penalty after the history
        and `tokens[:j]`, for `j = 0 .. len(tokens)` within `T`."""
        positions, vocab = x.shape
        tokens = [int(t) for t in tokens]
        state, keys, lengths = self.state, [], []
        for j in range(len(tokens) + 1):
            if first + j >= positions:
                break
            if j:
                state = state.copy()
                state.append(tokens[j - 1])
            follow, n = dry_candidates(state, self.config, self.single,
                                       lambda: self.history + tokens[:j])  # noqa: B023 - called at once
            keys.append(follow + (first + j) * vocab)
            lengths.append(n)
        if not keys:
            return
        keys_t, n_t = torch.cat(keys), torch.cat(lengths)
        if self.single:
            keep = ~self.config.breakers.single.to(keys_t.device)[keys_t % vocab]
            keys_t, n_t = keys_t[keep], n_t[keep]
        if not keys_t.numel():
            return
        unique, inverse = torch.unique(keys_t, return_inverse=True)
        longest = torch.zeros_like(unique).scatter_reduce_(0, inverse, n_t, "amax")
        x[unique // vocab, unique % vocab] -= penalty_of(longest, self.config).to(x.device)
