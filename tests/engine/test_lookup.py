"""Drafts copied from the context (clover.engine.drafts.lookup): the longest suffix n-gram's latest earlier occurrence,
as many tokens as the match is deep, and an index grown token by token that equals one built at once."""

from __future__ import annotations

import random

import pytest

from clover.engine.drafts.lookup import MAX_DEPTH, ContextLookup


def _brute_force(tokens: list[int], most: int, max_ngram: int, min_ngram: int) -> list[int]:
    end = len(tokens)
    for n in range(min(max_ngram, end), min_ngram - 1, -1):
        suffix = tokens[end - n:]
        for start in range(end - n - 1, -1, -1):  # latest occurrence that has a token after it
            if tokens[start:start + n] == suffix:
                depth = max(d for d in range(n, min(MAX_DEPTH, start + n) + 1)
                            if tokens[start + n - d:start + n] == tokens[end - d:])
                return tokens[start + n:start + n + min(most, depth)]
    return []


def test_the_longest_suffix_wins_over_a_later_shorter_match():
    # "1 2 3" occurred once (followed by 7 8); "2 3" occurred later too (followed by 9): the longer match wins
    lookup = ContextLookup([1, 2, 3, 7, 8, 5, 2, 3, 9, 4, 1, 2, 3], max_ngram=3, min_ngram=2)
    assert lookup.drafts(2) == [7, 8]
    assert lookup.drafts(0) == []
    lookup.extend([7])
    assert lookup.drafts(3) == [8, 5, 2]  # "2 3 7" -> what followed it


def test_the_latest_occurrence_and_no_match():
    lookup = ContextLookup([5, 6, 1, 5, 6, 2, 5, 6], max_ngram=4, min_ngram=2)
    assert lookup.drafts(4) == [2, 5]  # the latest "5 6" was followed by 2 5; a two-token match drafts two
    assert lookup.match(4) == ([2, 5], 2)
    lookup = ContextLookup([9, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6], max_ngram=4, min_ngram=2)
    assert lookup.match(10) == ([7, 0, 1, 2, 3, 4], 6)  # six tokens deep: up to six drafts, cut at the context's end
    assert ContextLookup([1, 2, 3, 4]).drafts(3) == []
    assert ContextLookup([1, 2, 1], min_ngram=2).drafts(3) == []  # a one-token match is below min_ngram
    assert ContextLookup([1, 2, 1], min_ngram=1).drafts(3) == [2]  # one token deep: one draft


@pytest.mark.parametrize("seed", range(5))
def test_an_index_grown_token_by_token_equals_a_brute_force_search(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(6) for _ in range(300)]  # a small vocabulary: matches of every length
    lookup = ContextLookup(tokens[:10], max_ngram=4, min_ngram=2)
    for i in range(10, len(tokens)):
        assert lookup.drafts(5) == _brute_force(tokens[:i], 5, 4, 2), i
        lookup.extend(tokens[i:i + 1])
    assert ContextLookup(tokens).drafts(5) == lookup.drafts(5)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="min_ngram"):
        ContextLookup([], max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="min_ngram"):
        ContextLookup([], min_ngram=0)
