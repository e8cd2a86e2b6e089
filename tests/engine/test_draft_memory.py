"""The drafting memory (clover.engine.drafts.draft_memory): the deepest match among earlier answers, its most frequent
continuation cut by probability and by the match's length, bounded by eviction; and in exact mode, drafts that
make a repeated answer cheaper and never change it."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from clover.engine import Engine, SamplingParams
from clover.engine.drafts.cost import ForwardCost
from clover.engine.drafts.draft_memory import MAX_MATCH, MAX_OCCURRENCES, NGRAMS, DraftMemory
from model_helpers import PROMPTS, tiny_model


def _brute_force(answers: list[list[int]], context: list[int], most: int, min_probability: float) -> list[int]:
    """The module docstring's definition, by scanning every answer: the positions (newest first, at most
    MAX_OCCURRENCES) after the longest n-gram key of the context that occurs, their deepest match, its most
    frequent continuation."""
    tail = context[-MAX_MATCH:]
    for n in NGRAMS:
        if len(tail) < n:
            continue
        found = []
        for a in reversed(range(len(answers))):
            answer = answers[a]
            for p in reversed(range(n, len(answer) + 1)):
                if answer[p - n:p] == tail[-n:]:
                    length = 0
                    while length < min(len(tail), p) and answer[p - length - 1] == tail[-length - 1]:
                        length += 1
                    found.append((length, a, p))
        found = found[:MAX_OCCURRENCES]
        if not found:
            continue
        match = max(f[0] for f in found)
        positions = [(a, p) for length, a, p in found if length == match]
        out, probability = [], 1.0
        while len(out) < min(most, match):
            counts = Counter(answers[a][p] if p < len(answers[a]) else None for a, p in positions)
            best = max(((t, c) for t, c in counts.items() if t is not None), key=lambda tc: tc[1], default=None)
            if best is None or probability * best[1] / len(positions) < min_probability:
                break
            probability *= best[1] / len(positions)
            out.append(best[0])
            positions = [(a, p + 1) for a, p in positions if p < len(answers[a]) and answers[a][p] == best[0]]
        return out
    return []


def test_the_most_frequent_continuation_of_the_deepest_match():
    memory = DraftMemory()
    for answer in ([1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 5, 6], [8, 2, 3, 7, 7, 7]):
        memory.add(answer)
    draft = memory.drafts([0, 2, 3], most=8)  # "2 3": followed by "4 5" twice, "7 7" once; two tokens matched
    assert (draft.tokens, draft.match) == ([4, 5], 2)
    assert draft.conditional == pytest.approx([2 / 3, 1.0])
    draft = memory.drafts([5, 1, 2, 3], most=8)  # "1 2 3" only in the first answer: deeper, so it alone counts
    assert (draft.tokens, draft.conditional, draft.match) == ([4, 5, 6], [1.0, 1.0, 1.0], 3)
    assert memory.drafts([1, 2, 3], most=2).tokens == [4, 5]
    assert memory.drafts([4, 4], most=8) is None and memory.drafts([1, 2, 3], most=0) is None
    assert memory.drafts([3, 4, 5, 6], most=8) is None  # an answer's end: nothing followed it


def test_a_continuation_below_the_probability_cut_off_is_not_drafted():
    memory = DraftMemory(min_probability=0.5)
    for answer in ([1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 7, 8]):
        memory.add(answer)
    assert memory.drafts([1, 2], most=4) is None  # each continuation followed a third of the time


@pytest.mark.parametrize("seed", range(4))
def test_drafts_equal_a_brute_force_scan_of_the_answers(seed):
    rng = random.Random(seed)
    answers = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(12)]
    memory = DraftMemory(min_probability=0.2)
    for answer in answers:
        memory.add(answer)
    for _ in range(200):
        context = [rng.randrange(5) for _ in range(rng.randrange(1, 50))]
        draft = memory.drafts(context, most=6)
        assert (draft.tokens if draft else []) == _brute_force(answers, context, 6, 0.2), context


def test_the_oldest_answers_leave_a_full_memory():
    memory = DraftMemory(capacity=40)
    for i in range(10):
        memory.add([100 + i, 1, 2, 3, 200 + i])
    stats = memory.stats()
    assert len(memory) <= 40 and stats["answers_added"] == 10 and stats["answers_evicted"] >= 2
    assert stats["tokens"] == len(memory) == 5 * stats["answers"]
    assert memory.drafts([100, 1], most=3) is None  # the first answer was evicted
    assert memory.drafts([109, 1], most=3).tokens == [2, 3]  # the newest is kept (a two-token match drafts two)
    assert memory.drafts([109, 1, 2], most=3).tokens == [3, 209]
    memory.add(list(range(1000, 1100)))  # longer than the whole capacity: its last 40 tokens stay
    assert len(memory) == 40 and memory.drafts([1060, 1061], most=2).tokens == [1062, 1063]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="capacity"):
        DraftMemory(capacity=0)
    with pytest.raises(ValueError, match="min_probability"):
        DraftMemory(min_probability=1.5)


def test_a_repeated_answer_is_drafted_from_memory_and_unchanged():
    """The second time a prompt is answered, the memory holds the first answer: its forwards verify long drafts
    from there and commit several tokens each; the tokens are block size 1's either way, and the memory off
    changes nothing but the forwards."""
    model = tiny_model("clover-tiny-dense")
    reference = Engine(model, 1, rule="threshold", eos_token_ids=[])
    want = {tuple(prompt): _tokens(reference, prompt) for prompt in PROMPTS[:2]}
    runs = {}
    for memory in (True, False):
        engine = Engine(model, 4, rule="exact", cost=ForwardCost.flat(), eos_token_ids=[],
                        rule_options={"memory": memory})
        forwards = []
        for prompt in PROMPTS[:2] + PROMPTS[:2]:
            tokens, stats = [], None
            for e in engine.run([prompt], 40, SamplingParams()):
                tokens += e.token_ids
                stats = e.stats or stats
            assert tokens == want[tuple(prompt)], prompt
            forwards.append(stats["forward_passes"])
        runs[memory] = engine.settings()["memory"], forwards
    (on, forwards_on), (off, forwards_off) = runs[True], runs[False]
    assert off == {"forwards": 0, "accepted": 0, "verified": 0}
    assert on["answers"] == 4 and on["tokens"] == 160
    assert on["accepted"] >= 30 and on["forwards"] > 0
    assert forwards_on[:2] == forwards_off[:2]  # nothing in memory yet: the same forwards
    assert sum(forwards_on[2:]) < sum(forwards_off[2:]) and max(forwards_on[2:]) <= 40 // 4


def _tokens(engine: Engine, prompt: list[int]) -> list[int]:
    out = []
    for e in engine.run([prompt], 40, SamplingParams()):
        out += e.token_ids
    return out
