"""Unmasking rules: which masked positions of a block a denoising step fills in.

Each rule is a small class with one method, `select(tokens, confidence, masked) -> accept`, on `[N, B]` tensors
for the whole batch at once (SGLang's `dllm/algorithm` style). Contract, checked by the tests:

* `accept` is a subset of `masked`;
* every row with at least one masked position accepts at least one — so a block always finishes in at most
  `B` steps and decoding never stalls;
* rows with nothing masked accept nothing (the engine passes `masked & active` for rows that sit a step out).

Rules are looked up by name in `RULES` (`make_rule("threshold", threshold=0.9)`); the engine never branches on
the rule's name. To add one: subclass `UnmaskingRule`, decorate with `@register_rule`, and list its name in
`clover.choices.RULE_NAMES` (what the CLI's `--rule` offers, known without importing torch). `exact` is not an
unmasking rule but a loop of its own (drafts verified by the causal path, clover.engine.loops.exact): `ExactRule` holds
its options, and its type is what makes the engine run that loop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from clover.config import check_threshold

RULES: dict[str, type["UnmaskingRule | ExactRule"]] = {}


def register_rule(cls: type["UnmaskingRule | ExactRule"]) -> type["UnmaskingRule | ExactRule"]:
    RULES[cls.name] = cls
    return cls


def make_rule(name: "str | UnmaskingRule | ExactRule", threshold: float | None = None,
              **options: Any) -> "UnmaskingRule | ExactRule":
    """Build a rule by name. `threshold` goes to rules that have one (others ignore it); other options must be
    fields of the rule (e.g. `k` of `top_k_per_step`, `adaptive` of `exact`)."""
    if isinstance(name, (UnmaskingRule, ExactRule)):
        return name
    if name not in RULES:
        raise ValueError(f"unknown unmasking rule {name!r}; available: {sorted(RULES)}")
    cls = RULES[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"rule {name!r} takes options {sorted(fields)}, got unknown {unknown}")
    if threshold is not None and "threshold" in fields:
        options["threshold"] = threshold
    return cls(**options)


@dataclass
class UnmaskingRule:
    name: ClassVar[str] = ""

    def select(self, tokens: torch.Tensor, confidence: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """`tokens`, `confidence`, `masked` `[N, B]` -> `accept` `[N, B]` bool (see the module contract)."""
        raise NotImplementedError

    @staticmethod
    def most_confident(confidence: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """One-hot `[N, B]` of each row's most confident masked position (all False where nothing is masked)."""
        conf = confidence.masked_fill(~masked, -1.0)
        best = torch.zeros_like(masked)
        best.scatter_(1, conf.argmax(dim=1, keepdim=True), True)
        return best & masked


@register_rule
@dataclass
class ThresholdRule(UnmaskingRule):
    """Fast-dLLM's parallel rule (docs/design.md §6): fill every masked position whose confidence is >= `threshold`,
    and always the single most confident one. `threshold=1.0` is one token per step, most confident first."""

    name: ClassVar[str] = "threshold"
    threshold: float = 0.9

    def __post_init__(self) -> None:
        check_threshold(self.threshold)

    def select(self, tokens: torch.Tensor, confidence: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        return (masked & (confidence >= self.threshold)) | self.most_confident(confidence, masked)


@register_rule
@dataclass
class TopKPerStepRule(UnmaskingRule):
    """A fixed budget: the `k` most confident masked positions per step (fewer if fewer are masked). Steps per
    block are exactly `ceil(B / k)` — predictable latency, no dependence on calibration."""

    name: ClassVar[str] = "top_k_per_step"
    k: int = 2

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")

    def select(self, tokens: torch.Tensor, confidence: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        k = min(self.k, masked.shape[1])
        conf = confidence.masked_fill(~masked, -1.0)
        top = conf.topk(k, dim=1).indices
        accept = torch.zeros_like(masked)
        accept.scatter_(1, top, True)
        return accept & masked


@register_rule
@dataclass
class NoAdjacentRepeatRule(ThresholdRule):
    """`threshold`, but a position is refused when its left neighbour is accepted in the same step with the same
    token. At low thresholds the denoiser, seeing both positions masked, often proposes the same word for both
    ("code code"); a feasibility run found them most of the damage (docs/clover-smol.md). The refused position
    stays masked and is re-predicted next step, now seeing its neighbour. The leftmost token of a run is kept,
    so the step still makes progress (an AR-trained model is best at the left end)."""

    name: ClassVar[str] = "no_adjacent_repeat"

    def select(self, tokens: torch.Tensor, confidence: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        accept = super().select(tokens, confidence, masked)
        repeat = accept[:, 1:] & accept[:, :-1] & (tokens[:, 1:] == tokens[:, :-1])
        refuse = torch.cat([torch.zeros_like(repeat[:, :1]), repeat], dim=1)
        return accept & ~refuse


@register_rule
@dataclass
class ProductThresholdRule(ThresholdRule):
    """Fill the most confident masked positions, best first, while the product of their confidences stays
    `>= threshold` (always at least the best one). The per-position rule bounds each token's error; this one
    bounds the step's: if the positions' predictions were independent, the product is the probability that
    every token filled in this step is the model's choice, so `k` tokens at 0.9 each (0.9^k) are not accepted
    together at threshold 0.9 — only as many as keep the product above it. `threshold=1.0` is one token per step.
    (Not SGLang's `joint_threshold`, a different rule: hence the name.)"""

    name: ClassVar[str] = "product_threshold"

    def select(self, tokens: torch.Tensor, confidence: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        conf, order = confidence.masked_fill(~masked, 0.0).sort(dim=1, descending=True)
        keep = conf.cumprod(dim=1) >= self.threshold  # a prefix of the sorted positions; unmasked ones weigh 0
        accept = torch.zeros_like(masked).scatter(1, order, keep)
        return (accept & masked) | self.most_confident(confidence, masked)


@register_rule
@dataclass
class LeftToRightRule(ThresholdRule):
    """The leftmost masked position, and the masked positions after it while each is `>= threshold`; nothing
    right of a masked position that waits. Filling a right position first fixes the text on both sides of a
    gap, and the gap's later fill must fit it: a token the model chose while imagining "Sydney" as one piece
    forces "Syd" into a one-token gap (seen on clover-smol's tool calls). Decided left to right, every
    accepted token has its whole left context decided or decided in the same step. `threshold=1.0` is one token
    per step in reading order."""

    name: ClassVar[str] = "left_to_right"

    def select(self, tokens: torch.Tensor, confidence: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        rank = masked.int().cumsum(dim=1)  # 1 at the leftmost masked position
        first = masked & (rank == 1)
        waits = masked & ~first & (confidence < self.threshold)
        return first | (masked & (waits.int().cumsum(dim=1) == 0))


@register_rule
@dataclass
class SubBlocksRule(ThresholdRule):
    """Fast-dLLM v2's schedule: a block decoded in sub-blocks of `size` from left to right, `threshold` applied
    inside the leftmost sub-block that still has masked positions; the positions right of it stay masked (and are
    read as masks) until it is full. With `size` >= the block size it is `threshold`."""

    name: ClassVar[str] = "sub_blocks"
    size: int = 8  # Fast-dLLM v2's `small_block_size`

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")

    def select(self, tokens: torch.Tensor, confidence: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        sub = torch.arange(masked.shape[1], device=masked.device) // self.size
        current = torch.where(masked, sub, masked.shape[1]).amin(dim=1, keepdim=True)  # leftmost with masks
        return super().select(tokens, confidence, masked & (sub == current))


@register_rule
@dataclass
class ExactRule:
    """Exact mode: the output is the model's causal choice (block size 1), token for token, at fewer forwards:
    every forward verifies drafted tokens causally, commits the longest prefix of drafts equal to the causal
    choice plus that choice at the first difference, undoes the cache state of the rest, and drafts anew from a
    query block of masks (clover.engine.loops.exact, docs/decoding.md "Exact mode"). `adaptive`: how many drafts to
    verify and to make is chosen per step from the runner's measured cost and the request's acceptance so far
    (clover.engine.drafts.drafting); False: always the whole block. `lookup`: a forward left without the query block's
    drafts (after a rejection) verifies drafts copied from the request's own context instead
    (clover.engine.drafts.lookup), when the context offers a continuation, or from the answers the engine gave before
    (`memory`: clover.engine.drafts.draft_memory), whichever matches the longer suffix of the context."""

    name: ClassVar[str] = "exact"
    adaptive: bool = True
    lookup: bool = True
    memory: bool = True
