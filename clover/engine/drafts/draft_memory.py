"""The drafting memory: drafts from the answers the engine has already given, for exact mode to verify.

An agent's requests repeat each other far more than one request repeats itself: the same tool-call skeletons,
argument names, paths and phrasing, turn after turn and task after task. So every finished answer joins a memory,
and a forward that has no draft from the model looks there for the current context's longest matching suffix and
follows what came after it in earlier answers (SuffixDecoding, arXiv 2411.04975, scores continuations this way):

    match     the earlier answer positions whose preceding tokens equal the context's last `L` tokens, `L` as
              long as any position allows (compared up to `MAX_MATCH`): the deepest node of a suffix tree
    follow    at each step the most frequent next token among the positions still following, `c / n` of them
              (`n` still following, `c` of them going on with that token); the draft's probability is the
              product of these ratios, and the draft stops where it falls below `min_probability`
    length    at most `L * length_factor` tokens: a long match is a long draft, a two-token match a short one

Exact mode verifies these drafts like any other, so what they are changes only the cost, never the output;
`conditional` (the `c / n` of each token) is what the cost model's acceptance estimate starts from.

The index is a hash chain per n-gram length (`NGRAMS`), as zlib's: a dict from an n-gram's hash to its latest
position, and per position the previous position with the same hash. Looking up walks a chain from the newest
occurrence back, at most `MAX_OCCURRENCES` of them, so what recent answers did counts first. An answer costs
O(len(NGRAMS)) per token to add; a lookup O(MAX_OCCURRENCES * MAX_MATCH) token comparisons at worst. Bounded by
`capacity` tokens: when full, the oldest answers are evicted (the store and index are rebuilt from the rest, down
to three quarters of the capacity, so eviction costs O(1) per token added on average).
"""

from __future__ import annotations

import threading
from array import array
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

from clover.choices import DRAFT_MEMORY_TOKENS
from clover.engine.drafts.lookup import MAX_DEPTH, ContextLookup

NGRAMS = (8, 4, 2)  # the chains, longest first: a long key finds the deep matches a short one's chain may bury
MAX_MATCH = MAX_DEPTH  # tokens compared backwards to measure a match, as for the context's drafts
MAX_OCCURRENCES = 32  # positions read from a chain per lookup, newest first
MIN_PROBABILITY = 0.1  # SuffixDecoding's default cut-off for a draft's probability
LENGTH_FACTOR = 1.0  # drafts of at most `match * LENGTH_FACTOR` tokens (SuffixDecoding's max_spec_factor)
END = -1  # between answers in the store: nothing matches or follows across it


@dataclass(frozen=True)
class MemoryDraft:
    """A continuation the memory proposes: `tokens`, each with the share `conditional[i]` of the matching
    positions (still following the draft before it) that went on with it; `match`: the context's tokens matched."""

    tokens: list[int]
    conditional: list[float]
    match: int


class DraftMemory:
    """Earlier answers (token ids), indexed for `drafts` (module docstring). Thread-safe: a server's scheduler
    thread reads and adds while another thread may read its `stats`."""

    def __init__(self, capacity: int = DRAFT_MEMORY_TOKENS, min_probability: float = MIN_PROBABILITY,
                 length_factor: float = LENGTH_FACTOR) -> None:
        if capacity < 1:
            raise ValueError(f"a drafting memory's capacity must be >= 1 token, got {capacity}")
        if not 0.0 <= min_probability <= 1.0:
            raise ValueError(f"min_probability must be in [0, 1], got {min_probability}")
        if length_factor <= 0:
            raise ValueError(f"length_factor must be > 0, got {length_factor}")
        self.capacity, self.min_probability, self.length_factor = capacity, min_probability, length_factor
        self._lock = threading.Lock()
        self._answers: deque[list[int]] = deque()
        self.answers_added = self.answers_evicted = 0
        self._reset()

    def _reset(self) -> None:
        self._tokens = array("q")  # every kept answer, each followed by END
        self._latest: dict[int, dict[int, int]] = {n: {} for n in NGRAMS}  # n -> hash of an n-gram -> position
        self._previous: dict[int, array] = {n: array("q") for n in NGRAMS}  # n -> position -> earlier one or -1

    def __len__(self) -> int:
        """Tokens kept (answers, without their separators)."""
        return len(self._tokens) - len(self._answers)

    def add(self, answer: Sequence[int]) -> None:
        """A finished answer joins the memory; the oldest leave when it is full (an answer longer than the whole
        capacity keeps its last `capacity` tokens)."""
        answer = [int(t) for t in answer][-self.capacity:]
        if not answer:
            return
        with self._lock:
            self.answers_added += 1
            if len(self) + len(answer) > self.capacity:
                keep, room = deque(), self.capacity * 3 // 4 - len(answer)
                for old in reversed(self._answers):
                    if len(old) > room:
                        break
                    keep.appendleft(old)
                    room -= len(old)
                self.answers_evicted += len(self._answers) - len(keep)
                self._answers = keep
                self._reset()
                for old in keep:
                    self._index(old)
            self._answers.append(answer)
            self._index(answer)

    def _index(self, answer: list[int]) -> None:
        """Append `answer` and END to the store; every position after an n-gram inside it joins that chain."""
        tokens, start = self._tokens, len(self._tokens)
        tokens.extend(answer)
        tokens.append(END)
        for n in NGRAMS:
            latest, previous = self._latest[n], self._previous[n]
            previous.extend([-1] * (len(tokens) - len(previous)))
            for p in range(start + n, start + len(answer) + 1):  # p: the position after the n-gram
                key = hash(tuple(tokens[p - n:p]))
                previous[p] = latest.get(key, -1)
                latest[key] = p

    def drafts(self, context: Sequence[int], most: int) -> MemoryDraft | None:
        """The continuation of `context`'s longest suffix that earlier answers share (module docstring), at most
        `most` tokens; None when no suffix of at least `min(NGRAMS)` tokens occurs, or `most` is 0."""
        if most <= 0:
            return None
        tail = [int(t) for t in context[-MAX_MATCH:]]
        with self._lock:
            for n in NGRAMS:
                if len(tail) < n:
                    continue
                at = self._latest[n].get(hash(tuple(tail[-n:])), -1)
                found: list[tuple[int, int]] = []  # (match length, position after it)
                while at >= 0 and len(found) < MAX_OCCURRENCES:
                    length = self._match(tail, at)
                    if length >= n:  # (a hash collision matches less)
                        found.append((length, at))
                    at = self._previous[n][at]
                if found:
                    return self._follow(found, most)
        return None

    def _match(self, tail: list[int], at: int) -> int:
        """How many of `tail`'s last tokens the store holds just before position `at` (within one answer)."""
        tokens, length = self._tokens, 0
        while length < len(tail) and at - length - 1 >= 0 and tokens[at - length - 1] == tail[-length - 1]:
            length += 1
        return length

    def _follow(self, found: list[tuple[int, int]], most: int) -> MemoryDraft | None:
        match = max(length for length, _ in found)
        positions = [at for length, at in found if length == match]  # the deepest node's occurrences
        limit = min(most, max(1, int(match * self.length_factor)))
        tokens, conditional, probability = [], [], 1.0
        store = self._tokens
        while len(tokens) < limit:
            counts = Counter(store[p] for p in positions)
            token, count = max(((t, c) for t, c in counts.items() if t != END), key=lambda tc: tc[1],
                               default=(END, 0))
            share = count / len(positions)
            if token == END or probability * share < self.min_probability:
                break
            probability *= share
            tokens.append(token)
            conditional.append(share)
            positions = [p + 1 for p in positions if store[p] == token]
        return MemoryDraft(tokens, conditional, match) if tokens else None

    def stats(self) -> dict[str, int]:
        """What the memory holds: answers and tokens kept, answers added and evicted so far, and the index's
        entries (distinct n-grams, over every chain length)."""
        with self._lock:
            return {"answers": len(self._answers), "tokens": len(self), "capacity": self.capacity,
                    "answers_added": self.answers_added, "answers_evicted": self.answers_evicted,
                    "ngrams": sum(len(latest) for latest in self._latest.values())}


def copied_drafts(index: ContextLookup, memory: DraftMemory | None, most: int,
                  context: bool = True) -> tuple[list[int], MemoryDraft | None, int]:
    """The drafts exact mode copies for a row: the continuation the context offers (`index.match`), or the
    memory's where it matches the context deeper; with the memory's draft when it won, and the depth of the match
    they continue (0 with no drafts). `context=False` leaves the context out (an offline comparison,
    benchmarks/replay_drafts.py)."""
    drafts, match = index.match(most) if context else ([], 0)
    found = memory.drafts(index.tokens, most) if memory is not None else None
    if found is not None and found.match > match:
        return found.tokens, found, found.match
    return drafts, None, match
