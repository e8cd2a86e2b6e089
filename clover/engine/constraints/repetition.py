"""Repetition: the DRY penalty (llama.cpp's semantics and parameter names) and the loop guard, on token histories.

**DRY** ("don't repeat yourself", p-e-w's sampler in text-generation-webui, llama.cpp's `dry`). The history `h` is
the request's last `dry_penalty_last_n` tokens (-1: all of them) of its prompt and output, or of its output alone
where the request leaves the prompt out (`dry_include_prompt`). If the last `n` tokens of `h` also occur earlier in
`h`, followed there by token `t`, then emitting `t` would extend that repeat to `n + 1` tokens; for
`n >= dry_allowed_length` its logit loses `dry_multiplier * dry_base ** (n - dry_allowed_length)`, with `n` the
longest such repeat. Sequence breakers stop matching: `n` never reaches back past the last breaker in
`h`, and a token that is a breaker by itself is never penalised. `dry_multiplier = 0` is off.

Breakers are strings (default `"\\n"`, `":"`, `'"'`, `"*"`); as llama.cpp does, a token whose text contains one is a
breaker by itself, and a token whose text ends with the start of one (`"foo\\n"` for a breaker `"\\n\\n"`) is a
breaker when the tokens after it spell the rest (tokenised here by the longest vocabulary match, at most 20 tokens).

Match lengths by lag. For a history `h_0 .. h_{L-1}`, `M[D]` (lag `D >= 1`) is the length of the longest common
suffix of `h` and `h` without its last `D` tokens: the repeat whose earlier copy ends `D` tokens before the end, the
token after that copy being `h_{L-D}`. Appending `t` updates every lag at once:

    M'[D] = M[D] + 1  if h_{L-D} == t  else 0        (D = 1 .. L; M[L] = 0)

one vectorised comparison per token (`LagMatches`). For a whole history at once `M` is the Z-array of the reversed
history (`lag_matches`, the Z-algorithm llama.cpp runs at every step). llama.cpp's window of `last_n_repeat =
min(len(h), last_n)` tokens and its breaker limit `rep_limit` cap a lag's match at `min(M[D], last_n_repeat - D,
rep_limit)` (the copy cannot start before the window), over lags `1 .. last_n_repeat - 1`. `naive_dry_penalty` is
the same penalty by brute force over all substrings, for the tests.

**Loop guard.** An answer whose last `span` tokens already occurred `repeats` times earlier in the answer (the prompt
not counted, copies may overlap) is ending in a loop: it ends there, `finish_reason` "repetition" (`RepeatGuard`,
applied where a request takes its committed tokens, clover.engine.request). The same lag matches over the
generated tokens count the copies: the lags with `M[D] >= span`.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

DEFAULT_BREAKERS = ("\n", ":", "\"", "*")  # llama.cpp's and text-generation-webui's defaults
MAX_BREAKER_CHARS = 40  # llama.cpp truncates a breaker to 40 characters and its tail to 20 tokens
MAX_TAIL_TOKENS = 20
BREAKER_CACHE_ENTRIES = 64  # distinct breaker lists an engine keeps resolved (BreakerCache)
FLOAT_MAX_LOG = 88.7228391  # log of float32's largest value: base ** exponent is clamped below it


def z_array(s: Sequence[int]) -> list[int]:
    """`z[i]`: the length of the longest common prefix of `s` and `s[i:]` (`z[0] = 0`). Linear (Z-algorithm)."""
    n = len(s)
    z = [0] * n
    left = right = 0  # [left, right): the rightmost segment known to match a prefix
    for i in range(1, n):
        k = min(right - i, z[i - left]) if i < right else 0
        while i + k < n and s[k] == s[i + k]:
            k += 1
        z[i] = k
        if i + k > right:
            left, right = i, i + k
    return z


def lag_matches(history: Sequence[int]) -> list[int]:
    """`M[D - 1]` for lags `D = 1 .. len(history) - 1` (module docstring): the Z-array of the reversed history."""
    return z_array(list(reversed(history)))[1:]


class LagMatches:
    """A growing history and its lag matches `M` as tensors, kept to the last `window` tokens (None: all), with the
    per-token update of the module docstring. `copy()` is cheap enough for a verification's per-position states."""

    def __init__(self, tokens: Sequence[int], window: int | None, device: torch.device | str = "cpu") -> None:
        tokens = list(tokens)[-window:] if window else list(tokens)
        self.window = window
        self.tokens = torch.tensor(tokens, dtype=torch.long, device=device)
        self.lags = torch.tensor(lag_matches(tokens), dtype=torch.long, device=device)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def copy(self) -> "LagMatches":
        new = LagMatches.__new__(LagMatches)
        new.window, new.tokens, new.lags = self.window, self.tokens, self.lags  # updates replace, never mutate
        return new

    def append(self, token: int) -> None:
        eq = self.tokens.flip(0) == token  # h_{L-D} for D = 1 .. L
        grown = torch.nn.functional.pad(self.lags, (0, 1))
        self.lags = torch.where(eq, grown + 1, torch.zeros_like(grown))
        self.tokens = torch.cat([self.tokens, self.tokens.new_tensor([token])])
        if self.window and len(self) > self.window:  # the oldest token leaves: so does the longest lag
            self.tokens, self.lags = self.tokens[1:], self.lags[:-1]

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(int(t))


@dataclass(frozen=True)
class Breakers:
    """Sequence breakers as token ids: `single` `[V]` (bool), tokens that are breakers by themselves; `tails`, per
    head token, the token sequences that complete a breaker after it."""

    single: torch.Tensor
    tails: dict[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)

    def single_ids(self) -> set[int]:
        return set(self.single.nonzero().flatten().tolist())


def breakers_from_texts(texts: Sequence[str], breakers: Sequence[str], device: torch.device | str = "cpu") -> Breakers:
    """Resolve breaker strings against the vocabulary's token `texts` (module docstring)."""
    single = torch.zeros(len(texts), dtype=torch.bool)
    tails: dict[int, set[tuple[int, ...]]] = {}
    by_text: dict[str, int] = {}
    for token, text in enumerate(texts):
        by_text.setdefault(text, token)
    for breaker in breakers:
        breaker = breaker[:MAX_BREAKER_CHARS]
        hits = [token for token, text in enumerate(texts) if breaker in text]  # one pass: start-up time
        single[hits] = True
        if len(breaker) == 1:  # a one-character breaker has no tails
            continue
        rests = {m: tuple(_longest_match_tokens(breaker[m:], by_text)[:MAX_TAIL_TOKENS])
                 for m in range(1, len(breaker))}  # the tokens that spell the breaker after its first m characters
        for token, text in enumerate(texts):
            if not text or breaker in text:
                continue
            for m in range(min(len(breaker) - 1, len(text)), 0, -1):  # the text ends with breaker[:m]
                if text.endswith(breaker[:m]) and rests[m]:
                    tails.setdefault(token, set()).add(rests[m])
    return Breakers(single.to(device), {h: tuple(sorted(t)) for h, t in tails.items()})


def _longest_match_tokens(text: str, by_text: dict[str, int]) -> list[int]:
    """`text` as vocabulary tokens (`by_text`: text -> id), greedily by the longest token text that starts it ([] if
    some part has none)."""
    out, i = [], 0
    while i < len(text):
        for j in range(len(text), i, -1):
            if text[i:j] in by_text:
                out.append(by_text[text[i:j]])
                i = j
                break
        else:
            return []
    return out


def rep_limit(history: Sequence[int], last_n_repeat: int, breakers: Breakers, single: set[int]) -> int:
    """How far back a repeat may reach: the tokens after the last complete breaker among the last `last_n_repeat`
    (all of them when there is none). As llama.cpp: scanning back from the end, the first token that heads a breaker
    whose tail (if any) follows it in full, the longest such tail."""
    n = len(history)
    for i in range(last_n_repeat):
        token = history[n - 1 - i]
        if token in single:
            return i
        best = -1
        for tail in breakers.tails.get(token, ()):
            s = len(tail)
            if best < s <= i and all(history[n - i + o] == tail[o] for o in range(s)):
                best = s
        if best >= 0:
            return i - best
    return last_n_repeat


@dataclass(frozen=True)
class DryConfig:
    """One request's DRY parameters (llama.cpp's names, without the `dry_` prefix) with its breakers resolved."""

    multiplier: float
    base: float
    allowed_length: int
    penalty_last_n: int  # -1: the whole history
    breakers: Breakers

    @property
    def window(self) -> int | None:
        return None if self.penalty_last_n == -1 else self.penalty_last_n

    @property
    def max_exponent(self) -> int:
        """`base ** exponent` is clamped below float32's overflow (0: no clamp), as llama.cpp does."""
        return int(FLOAT_MAX_LOG / math.log(self.base)) if self.base > 1.000001 else 0


def dry_candidates(state: LagMatches, cfg: DryConfig, single: set[int],
                   history: Callable[[], list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens that would extend a repeat after `state`'s history and the repeat's length `n` (>=
    `allowed_length`, possibly several entries per token: the caller takes the largest). `history` gives the
    history as a list (read only for the breaker scan)."""
    length = len(state)
    lnr = length if cfg.window is None else min(length, cfg.window)
    empty = state.tokens.new_zeros(0)
    if lnr <= cfg.allowed_length:
        return empty, empty
    limit = rep_limit(history(), lnr, cfg.breakers, single)
    if limit < cfg.allowed_length:
        return empty, empty
    lags = state.lags[: lnr - 1]  # lags 1 .. lnr - 1
    d = torch.arange(1, lnr, device=lags.device)
    n = torch.minimum(lags, lnr - d).clamp(max=limit)
    hit = n >= cfg.allowed_length
    following = state.tokens.flip(0)[: lnr - 1]  # h_{L-D}
    return following[hit], n[hit]


def penalty_of(n: torch.Tensor, cfg: DryConfig) -> torch.Tensor:
    """`multiplier * base ** (n - allowed_length)`, the exponent clamped as llama.cpp does (fp32)."""
    exponent = (n - cfg.allowed_length).float()
    if cfg.max_exponent > 0:
        exponent = exponent.clamp(max=cfg.max_exponent)
    return cfg.multiplier * torch.pow(torch.tensor(cfg.base, dtype=torch.float32, device=n.device), exponent)


def naive_dry_penalty(history: Sequence[int], cfg: DryConfig, vocab_size: int) -> torch.Tensor:
    """`[V]`: the DRY penalty after `history`, by the definition and nothing else — every earlier end position,
    its match length counted token by token inside the window and after the last breaker — for the tests."""
    out = torch.zeros(vocab_size)
    h = list(history)
    lnr = len(h) if cfg.window is None else min(len(h), cfg.window)
    if cfg.multiplier == 0 or lnr <= cfg.allowed_length:
        return out
    window = h[len(h) - lnr:]
    single = cfg.breakers.single_ids()
    limit = rep_limit(h, lnr, cfg.breakers, single)
    best: dict[int, int] = {}
    for end in range(len(window) - 1):  # an earlier copy ending at `end`, followed by window[end + 1]
        n = 0
        while n <= end and window[end - n] == window[-1 - n]:
            n += 1
        n = min(n, limit)
        token = window[end + 1]
        if n >= cfg.allowed_length and token not in single:
            best[token] = max(best.get(token, 0), n)
    for token, n in best.items():
        exponent = n - cfg.allowed_length
        if cfg.max_exponent > 0:
            exponent = min(exponent, cfg.max_exponent)
        out[token] = cfg.multiplier * cfg.base ** exponent
    return out


class RepeatGuard:
    """The loop guard of one request (module docstring): fed the generated tokens one at a time, `feed` says
    whether the last `span` tokens now occur at least `repeats` times before (then the answer ends there)."""

    def __init__(self, span: int, repeats: int) -> None:
        self.span, self.repeats = span, repeats
        self.matches = LagMatches([], None)

    def feed(self, token: int) -> bool:
        self.matches.append(token)
        return len(self.matches) > self.span and int((self.matches.lags >= self.span).sum()) >= self.repeats


class BreakerCache:
    """Breaker strings -> `Breakers` for one vocabulary of `vocab_size` ids (texts for the first `vocab_limit`),
    the token texts read once, on first use: from `token_texts` (all at once: fast) or by detokenizing each id.

    Keyed by values a client chooses, so bounded: the `capacity` most recently used (each ~`vocab_size` bytes plus
    its tails), least recently used evicted first. Thread-safe: a server resolves a request's breakers in a worker
    thread before queueing it (a resolution is a pass over the vocabulary per breaker: seconds for 32 long ones),
    and the scheduler thread then finds them here."""

    def __init__(self, vocab_size: int, vocab_limit: int, detokenize: Callable[[list[int]], str] | None = None,
                 token_texts: Callable[[], Sequence[str]] | None = None, capacity: int = BREAKER_CACHE_ENTRIES) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.vocab_size, self.vocab_limit, self.capacity = vocab_size, vocab_limit, capacity
        self.detokenize, self.token_texts = detokenize, token_texts
        self._texts: list[str] | None = None
        self._resolved: OrderedDict[tuple[str, ...], Breakers] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def texts(self) -> list[str]:
        with self._lock:
            if self._texts is None:
                if self.token_texts is not None:
                    texts = list(self.token_texts())[: self.vocab_limit]
                else:
                    texts = [self.detokenize([i]) for i in range(self.vocab_limit)]
                self._texts = texts + [""] * (self.vocab_size - len(texts))
            return self._texts

    def __call__(self, breakers: tuple[str, ...]) -> Breakers:
        with self._lock:
            hit = self._resolved.get(breakers)
            if hit is not None:
                self._resolved.move_to_end(breakers)
                return hit
        resolved = breakers_from_texts(self.texts(), breakers)  # outside the lock: a hit never waits for it
        with self._lock:
            self._resolved[breakers] = resolved
            self._resolved.move_to_end(breakers)
            while len(self._resolved) > self.capacity:
                self._resolved.popitem(last=False)
        return resolved
