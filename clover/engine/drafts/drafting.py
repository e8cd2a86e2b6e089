"""How many drafts exact mode verifies and drafts: the choice that maximises committed tokens per second.

A forward of exact mode reads the last decided token and `k` drafts causally, then `m + 1` masks (when `m > 0`)
that draft the `m` tokens after the one this forward decides: `1 + k + (m + 1)` rows, which cost `t(rows)`
(clover.engine.drafts.cost). Drafts are accepted left to right; draft `i` with probability `p_i` given the drafts
before it were, so with `a_i = p_1 ... p_i` a forward that verifies `M` drafts commits
`E_M = 1 + a_1 + ... + a_M` tokens on average, and leaves usable drafts (made after its last draft) only when all
`M` were accepted, probability `a_M`; otherwise the next forward has none to verify.

The policy "draft `M` every forward, verify all of them" alternates between forwards with drafts (rows
`2M + 2`) and fresh ones after a rejection (rows `M + 2`, one token). As a Markov chain it spends a share
`1 / (2 - a_M)` of its forwards with drafts, so its long-run rate is

    rate(M) = (E_M + (1 - a_M)) / (t(2M + 2) + (1 - a_M) t(M + 2)),    rate(0) = 1 / t(1)

and exact mode picks the `M` with the highest rate at every step, from the current context length and the
request's own acceptance estimate (`Acceptance`). `M = 0` is block size 1: one row, nothing drafted. Where rows
cost nearly nothing (a GPU), `M = B - 1`. The output never depends on the choice: only the cost does.

A batch of `n` requests shares each forward, a rectangle as wide as its widest row: one row's extra draft widens
every row. So a batch drafts one `M` for all (from its mean acceptance, each row paying `t(n R) / n`), and verifies
one `k` for all (`best_batch_verified`: the batch's expected tokens over the whole forward's cost), which is the
single-request choice when `n = 1`. On two CPU cores a batch of 16 then rarely drafts: its rows are already
arithmetic-bound (docs/decoding.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

DEFAULT_PRIOR = (0.5, 0.4, 0.3)  # draft acceptance assumed for a model that records none (per position, then the last)
PRIOR_STRENGTH = 2.0  # the prior counts as this many observed drafts per position
OPTIMISM = 1.0  # standard deviations added to each estimate: untried drafts get tried, and learn their rate
MEMORY = 0.99  # per forward, the weight evidence keeps: a request's text changes (prose, then a tool call)
CONFIDENCE_EMA = 0.3  # weight of the newest committed token in the running causal confidence


class Acceptance:
    """One request's running estimate of `p`, the chance that a draft is accepted when the drafts before it were:
    a Beta posterior from the model's measured prior (`config.draft_acceptance`, averaged over positions) and
    every draft the request has had verified, at any position (clover-smol's measured prior, its manifest's
    `draft_acceptance` from `benchmarks/bench_exact.py --prior`, falls with the position, 0.47 / 0.41 / 0.28; one
    parameter still learns three times as fast as three, and a position rarely reached is not left at its prior). Evidence fades by `MEMORY` a forward (`tick`), so the estimate follows the text the
    request is writing now.

    Decisions read `optimistic()`: the mean plus `OPTIMISM` standard deviations, so that with little evidence
    drafts look worth trying, but never above the causal path's own recent confidence (the probability it gave
    the tokens it committed, `observe_confidence`): a draft is accepted only when it is the causal choice, and
    where the model itself hesitates between tokens a drafter rarely guesses them. So a request writing
    predictable text (a tool call) gets drafts tried and keeps them while they are accepted; one writing free
    prose is not made to pay for trying."""

    def __init__(self, positions: int, prior: Sequence[float] | None = None,
                 strength: float = PRIOR_STRENGTH) -> None:
        prior = list(prior or DEFAULT_PRIOR)
        self.positions = positions
        self.prior = min(max(sum(prior) / len(prior), 1e-3), 1 - 1e-3)
        self.strength = strength
        self.accepted = self.tried = 0.0
        self.confidence = self.prior  # until the first committed token says otherwise

    def observe(self, verified: int, accepted: int) -> None:
        """A forward verified `verified` drafts and accepted the first `accepted` (the next one, if verified, was
        rejected; later ones were not reached)."""
        self.accepted += accepted
        self.tried += accepted + (accepted < verified)

    def observe_confidence(self, probabilities: Sequence[float]) -> None:
        """The causal path's probabilities of the tokens it just committed, in order."""
        for p in probabilities:
            self.confidence += CONFIDENCE_EMA * (p - self.confidence)

    def tick(self) -> None:
        """One forward has passed: older evidence weighs `MEMORY` times less."""
        self.accepted *= MEMORY
        self.tried *= MEMORY

    def mean(self) -> list[float]:
        """`p_1 .. p_positions`."""
        s = self.strength
        return [(s * self.prior + self.accepted) / (s + self.tried)] * self.positions

    def optimistic(self) -> list[float]:
        p = self.mean()[0] if self.positions else 0.0
        bonus = OPTIMISM * math.sqrt(p * (1 - p) / (self.strength + self.tried + 1))
        return [min(p + bonus, self.confidence)] * self.positions


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


def best_verified(p: Sequence[float], cost: Callable[[float], float], most: int, query: int) -> int:
    """Drafts (0 .. `most`) to verify in a forward that also carries `query` masks, when the drafts cost nothing to
    make (copied from the context): the most committed tokens per second of this forward, `E_k / t(1 + k + query)`;
    the fewer on a tie."""
    best, best_rate = 0, 1.0 / cost(1 + query)
    for k in range(1, most + 1):
        r = expected_tokens(p, k) / cost(1 + k + query)
        if r > best_rate * (1 + 1e-9):
            best, best_rate = k, r
    return best


def best_batch_verified(ps: Sequence[Sequence[float]], available: Sequence[int], cost: Callable[[float], float],
                        query: int) -> int:
    """A batch's one count of drafts to verify (0 .. the most any row has), every row as wide as the widest: the
    most committed tokens per second of the whole forward, `sum_r E_r(min(k, available_r)) / t(n (1 + k + query))`
    (`cost`: seconds of a forward of that many rows, the whole batch's); the fewer on a tie."""
    n = len(ps)
    best, best_rate = 0, n / cost(n * (1 + query))
    for k in range(1, max(available, default=0) + 1):
        tokens = sum(expected_tokens(p, min(k, a)) for p, a in zip(ps, available))
        r = tokens / cost(n * (1 + k + query))
        if r > best_rate * (1 + 1e-9):
            best, best_rate = k, r
    return best
