"""A thinking budget: a request bounds its reasoning to at most `N` tokens, after which the reasoning is closed with
the chat template's own closing text and the answer goes on.

The request field is vLLM's `thinking_token_budget` (SGLang calls its per-request budget `thinking_budget`,
llama.cpp `--reasoning-budget`); `clover generate` / `clover chat` take `--thinking-token-budget`.

Semantics (one per-request state machine, `BudgetTracker`, fed the answer's tokens in order)::

    idle       reasoning not open: the answer's first tokens may still be the open tag's (`<think>`)
    reasoning  counting: every token after the open tag counts until the close tag (`</think>`) completes
    closing    the count reached N without the close tag: the next tokens are the closing sequence, forced
    done       closed (by the model or by force): nothing more is constrained

Counting starts where reasoning opens: in the prompt (the template opened `<think>` and did not close it, the
prompt's last open tag after its last close tag, as vLLM reads it) or where the model writes the open tag as the
first tokens of its answer, where reasoning models open it (an answer that starts otherwise has no reasoning to
bound: vLLM and llama.cpp watch for the tag anywhere, which would cost a block rule its parallelism all answer
long, see below). Only generated tokens count (the prompt's own tokens after `<think>`, a `\\n`, do not). A budget
of 0 closes reasoning at once. One reasoning block per answer: after it closes, a later `<think>` is text.

The closing sequence is the text the template itself writes between a turn's reasoning and its answer (Qwen3.5's
and Clover's: `"\\n</think>\\n\\n"`; `closing_text`), so the forced answer continues exactly as the model saw turns
end in training; tokenised on its own, with the tokenizer that renders prompts. vLLM forces the end tag's tokens
alone (`</think>`) and lets the model write the blank line; llama.cpp forces an optional message and the end tag.
Tags are matched as token sequences (`<think>` and `</think>` are single special tokens in Qwen's vocabularies; a
tokenizer that splits them must split them the same way in context).

**How it fits the engine.** The budget is a token-level constraint with a grammar's verbs
(`clover.engine.constraints.grammar.Matcher`): `masks_for(drafts)` (the allowed tokens at the decision and after each
draft: one token where the closing sequence is due, no mask elsewhere), `consume`, `rollback`, `forced()` (the closing
sequence, decided with no forward of its own) and `draft`. Exact mode treats a request's constraint the same way
whichever it is, so its output is block-size-1 decoding with the same budget, token for token: a draft running
past the budget is checked against the forced token, and the forced tokens are committed as block size 1 commits
them. Block rules fill positions in any order; the tracker tells them how far into a block the model's own tokens
certainly go (`free`: no position past it is filled before the block's decided prefix reaches it, so while reasoning
a step fills at most the budget's remaining tokens past the prefix) and, once the prefix reaches the budget, what to
write next (`forced_after`): the closing sequence fills the following positions (into the next block when it does
not fit), and the block's remaining positions are decoded after it.

A request has a budget or a grammar, not both: a grammar-constrained answer is rendered without reasoning (its
prompt holds the answer's forced start), so it has no reasoning to bound, and a forced close inside a grammar's
answer would break the grammar; the engine refuses the pair, and the server gives a budget only to the free-text
path. Reasoning before a grammar's answer (llama.cpp holds its lazy grammar back while reasoning) would compose the
two: the budget's constraint until the close, the grammar's from there, the prompt no longer holding the answer's
forced start.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch

from clover.assistant_output import END_THINK, THINK
from clover.chat_template import render_chat
from clover.engine.constraints.grammar import draft_through

IDLE, REASONING, CLOSING, DONE = "idle", "reasoning", "closing", "done"
_REASONING_MARK, _ANSWER_MARK = "CLOVER-REASONING-MARK", "CLOVER-ANSWER-MARK"


def check_budget(value: Any) -> int:
    """`value` as a budget (an integer >= 0), or a ValueError naming the request field."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"thinking_token_budget must be an integer >= 0 (reasoning tokens before the close), "
                         f"got {value!r}")
    return int(value)


@dataclass(frozen=True)
class ThinkingBudget:
    """At most `tokens` reasoning tokens; the tags as token ids: `open_ids` opens reasoning, `close_ids` closes it
    when the model writes it, `closing_ids` is what is forced when the budget is spent (it contains the close)."""

    tokens: int
    open_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    closing_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        check_budget(self.tokens)
        for name in ("open_ids", "close_ids", "closing_ids"):
            if not getattr(self, name):
                raise ValueError(f"ThinkingBudget.{name} is empty: the tags must be tokens of the vocabulary")

    def tracker(self, prompt: Sequence[int], vocab_size: int, eos_ids: Sequence[int]) -> BudgetTracker:
        return BudgetTracker(self, prompt, vocab_size, eos_ids)


def closing_text(tokenizer: Any, template: str | None = None) -> str:
    """What `template` (default: the checkpoint's own) writes between an assistant turn's reasoning and its answer,
    when that contains the close tag (`"\\n</think>\\n\\n"` for Qwen3.5's and Clover's); else the close tag alone."""
    from jinja2.exceptions import TemplateError  # deferred: jinja2, for budgets only

    try:
        text = render_chat(tokenizer, [{"role": "user", "content": "?"},
                                       {"role": "assistant", "reasoning_content": _REASONING_MARK,
                                        "content": _ANSWER_MARK}], template=template)
    except (TemplateError, ValueError):  # a template that cannot render this turn: the tag alone
        return END_THINK
    start, end = text.find(_REASONING_MARK), text.find(_ANSWER_MARK)
    between = text[start + len(_REASONING_MARK): end] if 0 <= start < end else ""
    return between if END_THINK in between else END_THINK


def thinking_budget(tokens: int, tokenizer: Any, template: str | None = None) -> ThinkingBudget:
    """The budget of `tokens` reasoning tokens for a checkpoint's tokenizer and chat template (`closing_text`)."""
    encode = lambda text: tuple(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    return ThinkingBudget(check_budget(tokens), encode(THINK), encode(END_THINK),
                          encode(closing_text(tokenizer, template)))


class State(NamedTuple):
    phase: str  # IDLE, REASONING, CLOSING or DONE
    spent: int  # reasoning tokens so far
    at: int  # CLOSING: tokens of the closing sequence already written
    tail: tuple[int, ...]  # IDLE: the open tag's tokens written so far; REASONING: the last tokens that may start
    # the close tag


def _last_n(tokens: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The last `n` of `tokens` (none for `n = 0`)."""
    return tokens[len(tokens) - n:] if n else ()


def _last(tokens: Sequence[int], tag: Sequence[int]) -> int:
    """The start of `tag`'s last occurrence in `tokens`, or -1."""
    n = len(tag)
    return next((i for i in range(len(tokens) - n, -1, -1) if tuple(tokens[i:i + n]) == tuple(tag)), -1)


class BudgetTracker:
    """One request's place in its budget (module docstring), with rollback (exact mode undoes rejected drafts).
    `eos_ids`: the tokens that end the request (never fed to the budget); `forced_tokens`: tokens committed because
    the budget forced them (a request's stats)."""

    def __init__(self, budget: ThinkingBudget, prompt: Sequence[int], vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.budget, self.vocab_size, self.eos_ids = budget, vocab_size, list(eos_ids)
        opened = _last(prompt, budget.open_ids) > _last(prompt, budget.close_ids)
        self.history = [self._opened(0) if opened else State(IDLE, 0, 0, ())]
        self.forced_tokens = 0

    @property
    def state(self) -> State:
        return self.history[-1]

    @property
    def done(self) -> bool:
        return self.state.phase == DONE

    @property
    def reasoning_tokens(self) -> int:
        return self.state.spent

    def _opened(self, spent: int) -> State:
        return State(CLOSING, spent, 0, ()) if spent >= self.budget.tokens else State(REASONING, spent, 0, ())

    def _next(self, s: State, token: int) -> State:
        b = self.budget
        if s.phase == IDLE:
            tail = (*s.tail, token)
            if tail == b.open_ids:
                return self._opened(0)
            return s._replace(tail=tail) if b.open_ids[:len(tail)] == tail else State(DONE, 0, 0, ())
        if s.phase == REASONING:
            tail = (*s.tail, token)[-len(b.close_ids):]
            if tail == b.close_ids:
                return State(DONE, s.spent, 0, ())
            return self._opened(s.spent + 1)._replace(tail=_last_n(tail, len(b.close_ids) - 1))
        if s.phase == CLOSING:
            if token != b.closing_ids[s.at]:
                raise ValueError(f"the thinking budget forces token {b.closing_ids[s.at]} here, got {token}")
            return State(DONE, s.spent, 0, ()) if s.at + 1 == len(b.closing_ids) else s._replace(at=s.at + 1)
        return s

    def after(self, tokens: Sequence[int]) -> State:
        """The state after `tokens` (EOS ids skipped), from the current one; nothing is kept."""
        s = self.state
        for t in tokens:
            if t not in self.eos_ids:
                s = self._next(s, t)
        return s

    def consume(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if t not in self.eos_ids:
                self.history.append(self._next(self.state, t))

    def rollback(self, n: int) -> None:
        if n > len(self.history) - 1:
            raise ValueError(f"cannot roll the thinking budget back {n} tokens: it consumed {len(self.history) - 1}")
        del self.history[len(self.history) - n:]

    def due(self) -> int | None:
        """The token the budget forces next, or None where the model chooses."""
        s = self.state
        return self.budget.closing_ids[s.at] if s.phase == CLOSING else None

    def free(self, s: State) -> int | None:
        """How many tokens from `s` are certainly the model's own (None: all of them): a block rule decides only
        those. Idle, the open tag may complete after the tokens of it not yet written."""
        n = self.budget.tokens
        if s.phase == IDLE:
            return len(self.budget.open_ids) - len(s.tail) + n
        if s.phase == REASONING:
            return n - s.spent
        return 0 if s.phase == CLOSING else None

    def forced_after(self, tokens: Sequence[int]) -> list[int]:
        """The tokens forced right after `tokens` (a block's decided prefix): the rest of the closing sequence where
        the budget is spent there, else none."""
        s = self.after(tokens)
        return list(self.budget.closing_ids[s.at:]) if s.phase == CLOSING else []

    def forced(self) -> list[int]:
        """The tokens the budget forces from here (consumed): the rest of the closing sequence, or none."""
        s = self.state
        tokens = list(self.budget.closing_ids[s.at:]) if s.phase == CLOSING else []
        self.consume(tokens)
        self.forced_tokens += len(tokens)
        return tokens

    def masks_for(self, drafts: Sequence[int]) -> tuple[torch.Tensor | None, int]:
        """Masks `[1 + len(drafts), vocab_size]` for the decision and the token after each draft (None: nothing
        forced at any of them), consuming the drafts the budget allows; positions after the first disallowed
        draft (or an EOS) are unreachable and left unmasked. Returns the masks and how many drafts were consumed."""
        masks: torch.Tensor | None = None
        for i in range(len(drafts) + 1):
            due = self.due()
            if due is not None:
                if masks is None:
                    masks = torch.ones(1 + len(drafts), self.vocab_size, dtype=torch.bool)
                masks[i] = False
                masks[i, due] = True
            if i == len(drafts):
                break
            d = drafts[i]
            if (due is not None and d != due) or d in self.eos_ids:
                return masks, i
            self.consume([d])
        return masks, len(drafts)

    def draft(self, logits: torch.Tensor) -> list[int]:
        """The drafter's choice `[m]` for the next `m` positions (`logits` `[m, V]`, the ids that may not be emitted
        already at -inf): the forced token where one is due, else the argmax; the state is left unchanged."""
        def choose(row: torch.Tensor) -> int:
            due = self.due()
            return due if due is not None else int(row.argmax())

        return draft_through(self, logits, choose)
