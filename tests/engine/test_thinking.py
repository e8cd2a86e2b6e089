"""A thinking budget (clover.engine.constraints.thinking): at most N reasoning tokens, then the template's closing
text, then the answer; exact mode with a budget is block-size-1 decoding with the same budget token for token (alone,
batched, with drafts accepted and rejected across the budget), block rules keep it too, and what cannot be combined is
refused."""

from __future__ import annotations

import pytest
import torch

from clover.chat_template import CLOVER_CHAT_TEMPLATE, render_chat
from clover.engine import Engine, RequestOptions, generate
from clover.engine.decoding import ExactRule
from clover.engine.constraints.thinking import (DONE, REASONING, BudgetTracker, ThinkingBudget, closing_text,
                                                thinking_budget)
from model_helpers import tiny_model
from server_helpers import ScriptedLM
from test_exact_mode import OracleLoop

MAX_NEW = 24
BUDGETS = (0, 3, 7, 1000)  # 1000: more than the model writes
EXACT = ExactRule(adaptive=False)  # drafts sized without timing the machine: the output does not depend on it


@pytest.fixture(scope="module")
def model(chat_tokenizer):
    return tiny_model("clover-tiny", vocab_size=len(chat_tokenizer), mask_token_id=chat_tokenizer.mask_token_id,
                      eos_token_id=chat_tokenizer.eos_token_id, logit_scale=3.0)


def _prompts(tok, thinking: bool = True) -> list[list[int]]:
    """Chat prompts in Clover's template; with `thinking` the generation prompt opens `<think>`."""
    return [tok(render_chat(tok, [{"role": "user", "content": text}], add_generation_prompt=True,
                            enable_thinking=thinking), add_special_tokens=False)["input_ids"]
            for text in ("What is the weather in Paris?", "def add(x, y):", "Hello world.")]


def _budget(tok, n: int) -> ThinkingBudget:
    return thinking_budget(n, tok)


def _holds(tokens: list[int], tag: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i:i + len(tag)]) == tag for i in range(len(tokens)))


def _greedy(model, prompt: list[int], max_new: int, eos: list[int]) -> list[int]:
    return generate(model, [prompt], max_new, block_size=1, rule=EXACT, eos_token_ids=eos).sequences[0] \
        if max_new > 0 else []


def _reference(model, prompt: list[int], budget: ThinkingBudget, eos: list[int]) -> list[int]:
    """What a budget means, built from unbudgeted greedy decoding: its first N tokens, the closing sequence, then
    greedy decoding again after them (the random model never writes the close tag itself)."""
    free = _greedy(model, prompt, MAX_NEW, eos)
    n = budget.tokens
    assert not _holds(free, budget.close_ids)
    if len(free) < n:  # the answer ended (EOS or max_new) before the budget did
        return free
    head = free[:n] + list(budget.closing_ids)
    return (head + _greedy(model, prompt + head, MAX_NEW - len(head), eos))[:MAX_NEW]


@pytest.mark.parametrize("n", BUDGETS)
def test_a_budget_closes_reasoning_after_n_tokens_and_the_answer_goes_on(model, chat_tokenizer, n):
    eos, budget = [chat_tokenizer.eos_token_id], _budget(chat_tokenizer, n)
    assert closing_text(chat_tokenizer) == "\n</think>\n\n"
    for prompt in _prompts(chat_tokenizer):
        out = generate(model, [prompt], MAX_NEW, block_size=1, rule="threshold", eos_token_ids=eos,
                       thinking_budget=budget)
        want = _reference(model, prompt, budget, eos)
        assert out.sequences[0] == want
        assert out.stats[0]["reasoning_tokens"] == min(n, len(want))
        if n < MAX_NEW - len(budget.closing_ids):
            assert want[n:n + len(budget.closing_ids)] == list(budget.closing_ids)
            assert chat_tokenizer.decode(want).count("</think>") == 1


@pytest.mark.parametrize("block_size", [4, 8])
def test_exact_mode_with_a_budget_equals_block_size_1(model, chat_tokenizer, block_size):
    eos, prompts = [chat_tokenizer.eos_token_id], _prompts(chat_tokenizer)
    for budgets in ((0, 0, 0), (3, 3, 3), (0, 5, 1000), (7, 1000, 2)):  # uniform, and a budget per row
        sampling = [RequestOptions.of(thinking_budget=_budget(chat_tokenizer, n)) for n in budgets]
        want = generate(model, prompts, MAX_NEW, block_size=1, rule=EXACT, eos_token_ids=eos,
                        options=sampling).sequences
        assert want == [_reference(model, p, s.thinking_budget, eos) for p, s in zip(prompts, sampling)]
        got = generate(model, prompts, MAX_NEW, block_size=block_size, rule=EXACT, eos_token_ids=eos,
                       options=sampling).sequences
        assert got == want, budgets
        for p, s, w in zip(prompts, sampling, want):  # alone as in the batch
            assert generate(model, [p], MAX_NEW, block_size=block_size, rule=EXACT, eos_token_ids=eos,
                            options=s).sequences[0] == w


@pytest.mark.parametrize("wrong", [0.0, 0.3])
def test_drafts_across_the_budget_are_checked_against_the_forced_close(model, chat_tokenizer, wrong):
    """Drafts from the budgeted reference (some wrong) run into and past the closing sequence: accepted while equal
    to the constrained choice, so the output is still block size 1's."""
    eos, prompts = [chat_tokenizer.eos_token_id], _prompts(chat_tokenizer)
    sampling = [RequestOptions.of(thinking_budget=_budget(chat_tokenizer, n)) for n in (2, 5, 0)]
    want = [_reference(model, p, s.thinking_budget, eos) for p, s in zip(prompts, sampling)]
    engine = Engine(model, 8, rule=EXACT, eos_token_ids=eos)
    engine.loop = OracleLoop(engine, dict(enumerate(want)), wrong)
    out = [[] for _ in prompts]
    for ev in engine.run(prompts, MAX_NEW, sampling):
        if hasattr(ev, "token_ids"):
            out[ev.seq_id] += ev.token_ids
    assert out == want


def test_a_spent_budget_leaves_the_constrained_path(model, chat_tokenizer, monkeypatch):
    """Once the reasoning is closed (here by the budget) the budget binds nothing more: exact mode stops masking,
    rolling back and redrawing drafts for it (the constrained path's per-row work), while drafts from the budgeted
    reference, some wrong, still run into and past the close; the output is block size 1's and the stats keep the
    budget's counts."""
    phases = []
    masks_for = BudgetTracker.masks_for

    def spy(self, drafts):
        phases.append(self.state.phase)
        return masks_for(self, drafts)

    monkeypatch.setattr(BudgetTracker, "masks_for", spy)
    eos, prompts = [chat_tokenizer.eos_token_id], _prompts(chat_tokenizer)
    sampling = [RequestOptions.of(thinking_budget=_budget(chat_tokenizer, n)) for n in (2, 5, 0)]
    want = [_reference(model, p, s.thinking_budget, eos) for p, s in zip(prompts, sampling)]
    phases.clear()
    engine = Engine(model, 8, rule=EXACT, eos_token_ids=eos)
    engine.loop = OracleLoop(engine, dict(enumerate(want)), 0.3)
    out, stats = [[] for _ in prompts], [None] * len(prompts)
    for ev in engine.run(prompts, MAX_NEW, sampling):
        if hasattr(ev, "token_ids"):
            out[ev.seq_id] += ev.token_ids
            stats[ev.seq_id] = ev.stats or stats[ev.seq_id]
    assert out == want
    assert phases and DONE not in phases  # consulted while reasoning and closing, never after
    closing = len(sampling[0].thinking_budget.closing_ids)  # forced, or drafted and checked against the forced
    assert all(0 < s["forced_tokens"] <= closing for s in stats) and [s["reasoning_tokens"] for s in stats] == [2, 5, 0]


@pytest.mark.parametrize("rule, options", [("threshold", {}), ("top_k_per_step", {"k": 3}),
                                           ("no_adjacent_repeat", {})])
@pytest.mark.parametrize("block_size", [4, 8])
def test_block_rules_keep_the_budget(model, chat_tokenizer, rule, options, block_size):
    """Positions fill in any order, yet the reasoning is exactly N tokens (the model never closes it itself), the
    closing sequence follows, and the answer is decoded after it."""
    eos, prompts = [chat_tokenizer.eos_token_id], _prompts(chat_tokenizer)
    for n in (0, 2, 6, 9):
        budget = _budget(chat_tokenizer, n)
        close = list(budget.closing_ids)
        out = generate(model, prompts, MAX_NEW, block_size=block_size, threshold=0.3, rule=rule,
                       rule_options=options or None, eos_token_ids=eos, thinking_budget=budget)
        for tokens, stats in zip(out.sequences, out.stats):
            if len(tokens) < n:  # ended (EOS) within the budget
                assert not _holds(tokens, budget.close_ids) and stats["reasoning_tokens"] == len(tokens)
                continue
            assert not _holds(tokens[:n], budget.close_ids)
            assert tokens[n:n + len(close)] == close[: len(tokens) - n]
            assert stats["reasoning_tokens"] == n


def test_without_reasoning_in_the_prompt_a_budget_changes_nothing(model, chat_tokenizer):
    """Thinking off: the prompt closed its (empty) think block, the model never opens another, nothing is forced."""
    eos, prompts = [chat_tokenizer.eos_token_id], _prompts(chat_tokenizer, thinking=False)
    # a block rule's first step fills only past the open tag's length and the budget: 1 leaves a block of 4 whole
    for rule, block_size, n in ((EXACT, 4, 0), ("threshold", 4, 1)):
        free = generate(model, prompts, MAX_NEW, block_size=block_size, rule=rule, eos_token_ids=eos)
        bounded = generate(model, prompts, MAX_NEW, block_size=block_size, rule=rule, eos_token_ids=eos,
                           thinking_budget=_budget(chat_tokenizer, n))
        assert bounded.sequences == free.sequences
        assert all(s["reasoning_tokens"] == 0 and s["forced_tokens"] == 0 for s in bounded.stats)


REASONING_TEXT = "I should think about the weather, then about Paris, then about the answer."


def _writes_its_own_think_block(prompt: str) -> str:
    return "<think>\n" + REASONING_TEXT + "\n</think>\n\nIt is sunny."


@pytest.mark.parametrize("rule, block_size", [(EXACT, 4), ("threshold", 4), ("threshold", 1)])
def test_a_model_that_opens_reasoning_itself_is_counted_from_its_tag(chat_tokenizer, rule, block_size):
    """A scripted model writes `<think>` itself (the prompt did not open it): the count starts after the tag; a
    budget larger than its reasoning leaves the answer as written (the model's own close ends the count)."""
    tok, eos = chat_tokenizer, [chat_tokenizer.eos_token_id]
    lm = ScriptedLM(tok, _writes_its_own_think_block, block_size=block_size)
    prompt = _prompts(tok, thinking=False)[0]
    written = tok(_writes_its_own_think_block(""), add_special_tokens=False)["input_ids"]
    budget = _budget(tok, 4)
    out = generate(lm, [prompt], 64, block_size=block_size, rule=rule, eos_token_ids=eos, thinking_budget=budget)
    start = len(budget.open_ids) + 4  # the tag, then 4 tokens of reasoning (the line break after the tag counts)
    assert out.sequences[0][:start] == written[:start]
    assert out.sequences[0][start: start + len(budget.closing_ids)] == list(budget.closing_ids)
    assert out.stats[0]["reasoning_tokens"] == 4
    roomy = generate(lm, [prompt], 64, block_size=block_size, rule=rule, eos_token_ids=eos,
                     thinking_budget=_budget(tok, 1000))
    assert roomy.sequences[0] == written and roomy.stats[0]["forced_tokens"] == 0


def test_the_tracker_counts_rolls_back_and_masks_drafts_past_the_budget(chat_tokenizer):
    budget = ThinkingBudget(2, open_ids=(10, 11), close_ids=(20,), closing_ids=(30, 20, 31))
    t = budget.tracker([1, 2, 3], vocab_size=64, eos_ids=[0])
    assert t.state.phase == "idle" and t.free(t.state) == 4  # the whole tag, then the budget
    t.consume([10])
    assert t.free(t.state) == 3  # half the tag is written
    assert t.after([12]).phase == "done"  # an answer that does not start with the tag has no reasoning
    t.consume([11, 5])
    assert t.state.phase == REASONING and t.reasoning_tokens == 1 and t.forced() == []
    masks, consumed = t.masks_for([6, 30, 7])  # one more reasoning token, then the close is due: 30, then 20
    assert consumed == 2 and masks[0].all()
    assert masks[1].nonzero().flatten().tolist() == [30] and masks[2].nonzero().flatten().tolist() == [20]
    t.rollback(2)
    assert t.state.phase == REASONING and t.reasoning_tokens == 1
    masks, consumed = t.masks_for([6, 8])  # a draft that is not the forced token is rejected
    assert consumed == 1 and masks[1].nonzero().flatten().tolist() == [30]
    assert t.forced() == [30, 20, 31] and t.done and t.forced_tokens == 3
    drafts = t.draft(torch.zeros(2, 64))
    assert drafts == [0]  # argmax of flat logits is id 0, an EOS: drafting stops there
    closed = budget.tracker([1, 10, 11, 4], vocab_size=64, eos_ids=[0])  # the prompt opened reasoning
    closed.consume([5, 20])  # the model closes it itself within the budget
    assert closed.done and closed.forced() == [] and closed.reasoning_tokens == 1
    assert budget.tracker([10, 11, 20], 64, [0]).state.phase == "idle"  # opened and closed in the prompt
    assert ThinkingBudget(0, (10,), (20,), (20,)).tracker([10], 64, [0]).due() == 20  # a budget of 0: at once


def test_closing_text_is_the_templates_own(chat_tokenizer):
    assert closing_text(chat_tokenizer, CLOVER_CHAT_TEMPLATE) == "\n</think>\n\n"
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert closing_text(chat_tokenizer, plain) == "</think>"  # a template that writes no reasoning: the tag alone
    assert thinking_budget(5, chat_tokenizer, plain).closing_ids == thinking_budget(5, chat_tokenizer).close_ids


def test_what_cannot_be_combined_is_refused(model, chat_tokenizer):
    from clover.engine.constraints.grammar import json_schema_grammar

    budget, prompt = _budget(chat_tokenizer, 3), _prompts(chat_tokenizer)[0]
    grammar = json_schema_grammar({"type": "object"}, chat_tokenizer)
    with pytest.raises(ValueError, match="thinking budget cannot be combined with a grammar"):
        generate(model, [prompt], 4, rule=EXACT, grammar=grammar, thinking_budget=budget)
    with pytest.raises(ValueError, match="logprobs cannot be combined with a thinking budget"):
        generate(model, [prompt], 4, rule=EXACT, options=RequestOptions.of(thinking_budget=budget, logprobs=0))
    for bad in (-1, 2.5, "3", True):
        with pytest.raises(ValueError, match="thinking_token_budget must be an integer >= 0"):
            thinking_budget(bad, chat_tokenizer)
