"""How many drafts exact mode verifies and drafts: the choice that maximises committed tokens per second.

A forward of exact mode reads the last decided token and `k` drafts causally, then `m + 1` masks (when `m > 0`)
that draft the `m` tokens after the one this forward decides: `1 + k + (m + 1)` rows, which cost `t(rows)`
(clover.engine.cost). Drafts are accepted left to right; draft `i` with probability `p_i` given the drafts
before it were, so with `a_i = p_1 ... p_i` a forward that verifies `M` drafts commits
`E_M = 1 + a_1 + ... + a_M` tokens on average, and leaves usable drafts (made after its last draft) only when all
`M` were accepted, probability `a_M`; otherwise the next forward has none to verify.

The policy "draft `M` every forward, verify all of them" alternates between forwards with drafts (rows
`2M + 2`) and fresh ones after a rejection (rows `M + 2`, one token). As a Markov chain it spends a share
`1 / (2 - a_M)` of its forwards with drafts, so its long-run rate is

    rate(M) = (E_M + (1 - a_M)) / (t(2M + 2) + (1 - a_M) t(M + 2)),    rate(0) = 1 / t(1)

and exact mode picks the `M` with the highest rate at every step, from the current context length and the
request's own acceptance estimates (`Acceptance`). `M = 0` is block size 1: one row, nothing drafted. Where rows
cost nearly nothing (a GPU), `M = B - 1`. The output never depends on the choice: only the cost does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

DEFAULT_PRIOR = (0.5, 0.4, 0.3)  # draft acceptance assumed for a model that records none (per position, then the last)
PRIOR_STRENGTH = 4.0  # the prior counts as this many observed drafts per position
OPTIMISM = 1.0  # standard deviations added to each estimate: untried drafts get tried, and learn their rate


class Acceptance:
    """One request's running estimate of `p_i`, the chance that draft `i` is accepted when drafts `1..i-1` were:
    a Beta posterior per position, from the model's measured prior (`config.draft_acceptance`).

    Decisions read `optimistic()`, the mean plus one standard deviation: a position never verified keeps a
    hopeful estimate, so a request whose text turns predictable (a tool call after a sentence) gets tried and
    found out, while a settled estimate is the plain mean."""

    def __init__(self, positions: int, prior: Sequence[float] | None = None,
                 strength: float = PRIOR_STRENGTH) -> None:
        prior = list(prior or DEFAULT_PRIOR)
        prior = [min(max(float(p), 1e-3), 1 - 1e-3) for p in prior + [prior[-1]] * max(positions - len(prior), 0)]
        self.accepted = [p * strength for p in prior[:positions]]
        self.tried = [strength] * positions

    def observe(self, verified: int, accepted: int) -> None:
        """A forward verified `verified` drafts and accepted the first `accepted`: positions `1..accepted` were
        accepted, position `accepted + 1` (if verified) rejected, later ones not reached."""
        for i in range(min(accepted, len(self.tried))):
            self.accepted[i] += 1
            self.tried[i] += 1
        if accepted < verified and accepted < len(self.tried):
            self.tried[accepted] += 1

    def mean(self) -> list[float]:
        return [a / n for a, n in zip(self.accepted, self.tried)]

    def optimistic(self) -> list[float]:
        return [min(p + OPTIMISM * math.sqrt(p * (1 - p) / (n + 1)), 1.0) for p, n in zip(self.mean(), self.tried)]


def expected_tokens(p: Sequence[float], drafts: int) -> float:
    """`E_M`: tokens a forward verifying `drafts` drafts commits on average (the decided token included)."""
    total, reach = 1.0, 1.0
    for i in range(drafts):
        reach *= p[i]
        total += reach
    return total


def rate(p: Sequence[float], drafts: int, cost: Callable[[float], float]) -> float:
    """Long-run tokens per second of drafting and verifying `drafts` drafts per forward (module docstring)."""
    if drafts == 0:
        return 1.0 / cost(1)
    all_accepted = math.prod(p[:drafts])
    miss = 1.0 - all_accepted
    return (expected_tokens(p, drafts) + miss) / (cost(2 * drafts + 2) + miss * cost(drafts + 2))


def best_drafts(p: Sequence[float], cost: Callable[[float], float], most: int) -> int:
    """The number of drafts per forward (0 .. `most`) with the highest `rate`; the fewer on a tie."""
    best, best_rate = 0, rate(p, 0, cost)
    for m in range(1, most + 1):
        r = rate(p, m, cost)
        if r > best_rate * (1 + 1e-9):
            best, best_rate = m, r
    return best
