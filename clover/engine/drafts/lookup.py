"""Drafts copied from the request's own context (prompt lookup): free drafts for exact mode's forwards that
would otherwise have none.

Exact mode drafts with the model's query block, and those drafts are usable only when the forward that made them
accepted all its own (they were made after its last draft). After a rejection the next forward has nothing to
verify. Agents' text repeats its context: a tool call copies names and values from the tool descriptions and the
request, code repeats its identifiers. So the context itself proposes a continuation: the most recent earlier
occurrence of the last `n` tokens (the longest `n` in `[min_ngram, max_ngram]` that occurs), and the tokens that
followed it there, as many as the match is deep: the tokens before that occurrence that equal the context's own
last tokens, counted backwards up to `MAX_DEPTH` (an agent re-sent its previous answer: the match is deep and the
draft long; two tokens that recur by chance: a short one; SuffixDecoding's rule, arXiv 2411.04975). The causal
path verifies them like any draft, so the output is unchanged; only the cost moves.

The index maps each n-gram to the position after its latest occurrence that has a continuation, updated as tokens
are appended (O(max_ngram) per token); looking up the context's own last n-gram finds only earlier occurrences,
since its own continuation is not written yet.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_NGRAM = 4
MIN_NGRAM = 2  # a single token recurs everywhere: its continuations are mostly noise
MAX_DEPTH = 32  # tokens compared backwards to measure a match: deeper matches are all equally sure


class ContextLookup:
    """One request's n-gram index over its context (prompt, then every token it has committed)."""

    def __init__(self, tokens: Sequence[int] = (), max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest continued occurrence continues
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append `tokens` to the context."""
        for t in tokens:
            p = len(self.tokens)  # token `t` continues every n-gram that ends just before it
            for n in range(self.min_ngram, min(self.max_ngram, p) + 1):
                self._next[tuple(self.tokens[p - n:p])] = p
            self.tokens.append(int(t))

    def drafts(self, most: int) -> list[int]:
        """Up to `most` tokens that followed the latest earlier occurrence of the context's longest matching
        suffix, no more than the match is deep (module docstring); [] when no suffix of at least `min_ngram`
        tokens occurred before."""
        return self.match(most)[0]

    def match(self, most: int) -> tuple[list[int], int]:
        """`drafts(most)` and the depth of the match they continue (0 with no drafts)."""
        if most <= 0:
            return [], 0
        tokens, end = self.tokens, len(self.tokens)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            at = self._next.get(tuple(tokens[end - n:]))
            if at is not None:
                depth = n
                while depth < MAX_DEPTH and depth < at and tokens[at - depth - 1] == tokens[end - depth - 1]:
                    depth += 1
                return tokens[at:at + min(most, depth)], depth
        return [], 0
