"""`Sequence`: one request's state and bookkeeping — what it has produced, why it stopped, what it cost — and
`RequestOptions`: everything the request asked for, built and checked once.

The engine owns the tensors (cache, current block) of the whole batch; a `Sequence` owns the Python-side facts
of one request: its prompt, its options, the tokens committed so far, the steps each block took, and the
timestamps its stats are computed from. Appending a finished block is where EOS, `max_new_tokens`, stop strings
and the loop guard (clover.engine.constraints.repetition) are applied, so that "what counts as generated" is decided
in exactly one place; the EOS cut itself is `before_eos`
(a list of tokens) and `through_eos` (rows of a tensor, for the loops: no step or draft is spent after an EOS).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Sequence as Seq

import torch

from clover.config import check_threshold
from clover.engine.drafts.draft_memory import DraftMemory
from clover.engine.constraints.grammar import Matcher
from clover.engine.logprobs import MAX_TOP_LOGPROBS
from clover.engine.constraints.repetition import RepeatGuard
from clover.engine.sampling import SamplingParams
from clover.engine.constraints.thinking import BudgetTracker

Detokenize = Callable[[list[int]], str]

EOS, STOP, LENGTH, REPETITION = "eos", "stop", "length", "repetition"


def before_eos(piece: Seq[int], eos_ids: Seq[int]) -> tuple[list[int], bool]:
    """The tokens of `piece` before its first EOS (EOS and what follows never count), and whether it had one."""
    cut = next((i for i, t in enumerate(piece) if t in eos_ids), None)
    return (list(piece), False) if cut is None else (list(piece[:cut]), True)


def through_eos(tokens: torch.Tensor, eos: torch.Tensor, bound: torch.Tensor,
                where: torch.Tensor | None = None) -> torch.Tensor:
    """`bound` `[N]` lowered, per row of `tokens` `[N, T]`, to just past its first EOS (among `where`, if given):
    the positions that can still count."""
    hit = torch.isin(tokens, eos)
    if where is not None:
        hit &= where
    return torch.where(hit.any(1), torch.minimum(bound, hit.int().argmax(1) + 1), bound)


@dataclass(frozen=True)
class RequestOptions:
    """What one request asks of the engine besides its prompt and length: how its logits become tokens
    (`sampling`, its seed resolved once: `resolved`), when it ends, what constrains it, what it reports, its rule's
    own option and the answers it drafts from. Every check of a request's options (and of which combine) is here;
    a server maps the `ValueError` to a 400."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()  # stop strings (need a detokenizer in the engine)
    # loop guard: end the answer (finish_reason "repetition") once its last `loop_guard_span` tokens occurred
    # `loop_guard_repeats` times before in it; 0: off
    loop_guard_span: int = 0
    loop_guard_repeats: int = 2
    # a `clover.engine.constraints.grammar.Grammar` the output must follow (exact mode); None: free text
    grammar: Any = field(default=None, compare=False)
    # a `clover.engine.constraints.thinking.ThinkingBudget`: at most so many reasoning tokens, then the template's
    # closing text is forced; None: reasoning unbounded
    thinking_budget: Any = field(default=None, compare=False)
    # report each emitted token's log-probability and this many alternatives (clover.engine.logprobs);
    # None: none (nothing is computed)
    logprobs: int | None = None
    threshold: float | None = None  # a block rule's confidence threshold for this row (None: the engine's)
    ignore_eos: bool = False  # the engine's EOS does not end it (it runs to `max_new_tokens`)
    # earlier answers it drafts from and joins when it finishes (clover.engine.drafts.draft_memory; exact mode);
    # None: none (`Engine.run` gives its requests the engine's own)
    memory: DraftMemory | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.loop_guard_span < 0:
            raise ValueError(f"loop_guard_span must be >= 0 (0 = off), got {self.loop_guard_span}")
        if self.loop_guard_repeats < 1:
            raise ValueError(f"loop_guard_repeats must be >= 1, got {self.loop_guard_repeats}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] (alternatives per token) or None, "
                             f"got {self.logprobs}")
        if self.threshold is not None:
            check_threshold(self.threshold)
        if self.logprobs is not None and (self.grammar is not None or self.thinking_budget is not None):
            what = "a grammar" if self.grammar is not None else "a thinking budget"
            raise ValueError(f"logprobs cannot be combined with {what} (the tokens {what} forces are decided "
                             "without the model's logits)")
        if self.grammar is not None and self.thinking_budget is not None:
            raise ValueError("a thinking budget cannot be combined with a grammar (a grammar's answer has no "
                             "reasoning to bound, and a forced close would break it; "
                             "clover.engine.constraints.thinking)")

    @classmethod
    def of(cls, **keywords: Any) -> RequestOptions:
        """Options from keywords of either level: `SamplingParams`' fields build `sampling`, the rest are these
        options' own (`generate(..., temperature=0.7, stop=["."])`); a keyword given as None takes its default (a
        command line's unset option); `TypeError` names any unknown one."""
        unknown = sorted(set(keywords) - KEYWORDS)
        if unknown:
            raise TypeError(f"unknown generation arguments {unknown}; the options are {sorted(KEYWORDS)}")
        keywords = {k: v for k, v in keywords.items() if v is not None}
        sampling = {k: keywords.pop(k) for k in list(keywords) if k in SAMPLING_FIELDS}
        return cls(SamplingParams(**sampling), **keywords)

    def resolved(self) -> RequestOptions:
        """These options with the seed their draws are keyed by (`SamplingParams.resolved`): drawn once, when the
        engine takes the request, and kept with it so that a record of it reproduces its tokens."""
        sampling = self.sampling.resolved()
        return self if sampling is self.sampling else replace(self, sampling=sampling)


SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
# what `RequestOptions.of` (and `generate`'s keywords) take: both levels' fields
KEYWORDS = SAMPLING_FIELDS | {f.name for f in fields(RequestOptions)} - {"sampling"}
# DRY's and the loop guard's options, by name (what the API and the CLI pass on by name)
REPETITION_FIELDS = tuple(f.name for f in (*fields(SamplingParams), *fields(RequestOptions))
                          if f.name.startswith(("dry_", "loop_guard_")))


Options = RequestOptions | SamplingParams  # a request's options (bare sampling parameters ask nothing else)


def as_options(options: Options) -> RequestOptions:
    """A request's options; bare `SamplingParams` are options that ask nothing else."""
    return options if isinstance(options, RequestOptions) else RequestOptions(options)


@dataclass
class Sequence:
    seq_id: int  # what its events carry as their `index`: its position in the prompts given to the engine, or the
    # id the caller gave it (`Engine.make_sequences(ids=...)`: the scheduler's, unique across its batches)
    prompt: list[int]
    options: RequestOptions  # resolved (its seed drawn) and checked
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)
    steps_per_block: list[int] = field(default_factory=list)
    forwards: int = 0  # forwards that fed its steps (the prefill's extra chunks are `prefill_forwards`)
    finish_reason: str | None = None  # "eos" | "stop" | "length" | "repetition"
    stop_string: str | None = None  # the stop string that ended it, if any
    prefill_forwards: int = 0
    start_time: float = 0.0
    first_output_time: float | None = None
    end_time: float | None = None
    matcher: Matcher | None = None  # where the request is in its grammar (`options.grammar`), if it has one
    budget: BudgetTracker | None = None  # where the request is in its thinking budget (`options.thinking_budget`)
    guard: RepeatGuard | None = field(default=None, repr=False)  # the loop guard (`options.loop_guard_span`)
    drafts: dict[str, list[int]] = field(default_factory=dict)  # exact mode: by source ("model", "context",
    # "memory"), [drafts accepted, drafts verified]

    def __post_init__(self) -> None:
        if self.guard is None and self.options.loop_guard_span:
            self.guard = RepeatGuard(self.options.loop_guard_span, self.options.loop_guard_repeats)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tracker(self) -> Matcher | BudgetTracker | None:
        """Its grammar's matcher or its thinking budget (a request has at most one), with the verbs `masks_for`,
        `consume`, `rollback`, `forced`, `draft`."""
        return self.matcher if self.matcher is not None else self.budget

    @property
    def constraint(self) -> Matcher | BudgetTracker | None:
        """The tracker while it may still constrain what comes next, as exact mode consults it at a step's start
        (committed tokens only): a thinking budget that is done (its reasoning closed, or never opened) binds
        nothing more, so the rest of the answer takes the unconstrained path."""
        if self.matcher is not None:
            return self.matcher
        return self.budget if self.budget is not None and not self.budget.done else None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.generated)

    def append_block(self, block: Seq[int], steps: int, forwards: int, eos_ids: Seq[int],
                     detokenize: Detokenize | None, now: float | None = None) -> list[int]:
        """Take a finished block (already cut to at most `remaining` tokens), decided in `steps` steps fed by
        `forwards` forwards; return the piece that counts.

        EOS ends the request and is not part of the output, nor is anything after it; a stop string ends it after
        the token that completes the string (the caller trims the text); the loop guard ends it after the token
        that completes its repeat; reaching `max_new_tokens` ends it too.
        """
        now = time.perf_counter() if now is None else now
        self.steps_per_block.append(steps)
        self.forwards += forwards
        piece, ended = before_eos(block, eos_ids)
        if ended:
            self.finish_reason = EOS
        if self.options.stop and piece:
            cut, which = self._find_stop(piece, detokenize)
            if which is not None:
                piece, self.finish_reason, self.stop_string = piece[:cut], STOP, which
        if self.guard is not None:
            for i, token in enumerate(piece):
                if self.guard.feed(token):
                    piece, self.finish_reason, self.stop_string = piece[:i + 1], REPETITION, None
                    break
        self.generated.extend(piece)
        if self.finish_reason is None and self.remaining <= 0:
            self.finish_reason = LENGTH
        if self.first_output_time is None:
            self.first_output_time = now
        if self.finished:
            self.end_time = now
        return piece

    def stop_cut(self, prefix: Seq[int], eos_ids: Seq[int], detokenize: Detokenize) -> int | None:
        """The length of `prefix` (a block's decided first tokens) up to the token that completes a stop string,
        or None if none is complete in it yet; text after an EOS does not count (`append_block` drops it)."""
        piece, _ = before_eos(prefix, eos_ids)
        if not piece:
            return None
        cut, which = self._find_stop(piece, detokenize)
        return cut if which is not None else None

    def _find_stop(self, piece: list[int], detokenize: Detokenize | None) -> tuple[int, str | None]:
        """Smallest `k` such that the text up to `piece[:k]` contains a stop string (decoding only a short tail:
        earlier text was checked when its block was appended)."""
        if detokenize is None:
            raise ValueError("stop strings need a detokenizer (pass `detokenize=tokenizer.decode`)")
        tail = self._text_tail(max(len(s) for s in self.options.stop), detokenize)
        text = detokenize(tail + piece)
        if not any(s in text for s in self.options.stop):
            return len(piece), None
        for k in range(1, len(piece) + 1):
            text = detokenize(tail + piece[:k])
            for s in self.options.stop:
                if s in text:
                    return k, s
        return len(piece), None  # pragma: no cover - the full text contained it

    def _text_tail(self, chars: int, detokenize: Detokenize) -> list[int]:
        """The last generated tokens whose text holds more than `chars + 3` characters (or all of them): where a
        stop string that ends in the next piece can begin (+3: a tail that starts inside a character decodes its
        up to three stray UTF-8 bytes as replacement characters). Sized by text, not tokens: a byte-level token may
        hold a fraction of a character (an emoji can be four tokens), so a count of tokens per character would cut
        a multi-byte stop string short, and whether it is found would depend on how many tokens a piece brings."""
        n = chars + 1
        while n < len(self.generated) and len(detokenize(self.generated[-n:])) <= chars + 3:
            n *= 2
        return self.generated[-n:] if n < len(self.generated) else list(self.generated)

    def stats(self) -> dict[str, Any]:
        """The figures of docs/design.md §6 for this request.

        `forward_passes` counts the forwards that fed this request's steps: the prefill's last chunk, a step
        forward that computed logits for one of its positions, a commit+next-block forward — the same whether
        the request ran alone or in a batch. A step left with only block position 0 reuses the outputs it
        already has and runs none, so `forward_passes <= sum(steps_per_block)`. Extra prefill chunks of a long
        prompt are reported apart, as `prefill_forwards`.
        """
        end = self.end_time if self.end_time is not None else time.perf_counter()
        wall = end - self.start_time
        tokens = len(self.generated)
        forwards = self.forwards
        return {
            "prompt_tokens": len(self.prompt),
            "tokens": tokens,
            "forward_passes": forwards,
            "tokens_per_forward": tokens / forwards if forwards else 0.0,
            "wall_time_s": wall,
            "tokens_per_second": tokens / wall if wall > 0 else 0.0,
            "time_to_first_token_s": (self.first_output_time - self.start_time
                                      if self.first_output_time is not None else None),
            "steps_per_block": list(self.steps_per_block),
            "blocks": len(self.steps_per_block),
            "prefill_forwards": self.prefill_forwards,
            "finish_reason": self.finish_reason,
            "stop_string": self.stop_string,
            **({"forced_tokens": self.tracker.forced_tokens} if self.tracker is not None else {}),
            **({"reasoning_tokens": self.budget.reasoning_tokens} if self.budget is not None else {}),
            **({"drafts": {source: {"accepted": a, "verified": v} for source, (a, v) in self.drafts.items()}}
               if self.drafts else {}),
        }
