"""Position-keyed noise: a sampled token is drawn with random numbers that are a function of the request's seed and
the token's place in the answer, never of how many numbers were drawn before.

Why. Exact mode verifies a varying number of drafts per forward (its cost model picks it from measured timings and
the batch), and a block rule takes a varying number of steps. With one random stream per request consumed draw by
draw, a seed's text would follow those choices, hence the machine's load. Keyed by `(seed, position, step)`
instead, the token at answer position `t` is a deterministic function of the seed, `t` and the distribution there:
block size 1's token whenever the text before it is the same.

The draw is the exponential race (Gumbel-max): with `E_i ~ Exp(1)` independent over the vocabulary,
`argmax_i p_i / E_i` is a draw from `p` (`P(i wins) = p_i / sum_j p_j`; one pass, no cumulative sum). It is also
the robust choice for repeatability: a tiny change of `p` (another batch's floating-point sums) changes the token
only where two `p_i / E_i` nearly tie, not wherever a uniform lands near one of `V` cumulative boundaries.

The noise is a counter-based generator written in tensor operations, so a batch of keys costs one vectorised pass
and its integers are the same on every device (only the final `log` may round differently): a key is 64 bits (splitmix64 chained over seed, position and step);
per vocabulary index `i`, two rounds of Wellons' `lowbias32` integer hash keyed by the key's two halves give 32
bits, whose top 23 make `u` in (0, 1), exact in fp32, and `E = -log u`.
"""

from __future__ import annotations

import secrets
from typing import Sequence

import torch

_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
CHUNK_ELEMENTS = 1 << 21  # noise rows computed at once, in vocabulary entries: bounds the int64 temporaries (16 MB)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def noise_key(seed: int, position: int, step: int = 0) -> int:
    """The 64-bit key of the noise at answer `position` (0: the first generated token) and denoising `step` of a
    request seeded `seed` (any int; taken mod 2^64). Exact mode and block size 1 use step 0."""
    return _splitmix64(_splitmix64(_splitmix64(seed & _M64) ^ (position & _M64)) ^ (step & _M64))


def fresh_seed() -> int:
    """A seed for a request that gave none: fresh randomness, so unseeded requests differ from run to run."""
    return secrets.randbits(64)


def _lowbias32_(x: torch.Tensor) -> torch.Tensor:
    """In place: a bijection of 32-bit integers held in int64 (values in [0, 2^32)). Products wrap mod 2^64, whose
    low 32 bits are the 32-bit product, and the shifts see no sign bit."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x &= _M32
    x ^= x >> 15
    x *= 0x846CA68B
    x &= _M32
    x ^= x >> 16
    return x


def exponential_noise(keys: Sequence[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`[len(keys), vocab]` fp32 `Exp(1)` noise, row `j` a function of `keys[j]` alone (module docstring)."""
    halves = torch.tensor([[key & _M32, (key >> 32) & _M32] for key in keys], dtype=torch.long, device=device)
    x = torch.arange(vocab, dtype=torch.long, device=device)[None] ^ halves[:, :1]
    x = _lowbias32_(x)
    x ^= halves[:, 1:]
    x = _lowbias32_(x)
    # u in (0, 1), exact in fp32 (23 bits and the half), then E = -log u
    return (x >> 9).float().add_(0.5).mul_(2.0 ** -23).log_().neg_()


def race(probs: torch.Tensor, keys: Sequence[int]) -> torch.Tensor:
    """`[M]`: one token per row of `probs` `[M, V]` (need not be normalised), `argmax p / E` with row `j`'s noise
    keyed by `keys[j]`."""
    rows, vocab = probs.shape
    out = torch.empty(rows, dtype=torch.long, device=probs.device)
    chunk = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, rows, chunk):
        part = probs[start:start + chunk]
        out[start:start + chunk] = (part / exponential_noise(keys[start:start + chunk], vocab, probs.device)).argmax(-1)
    return out
