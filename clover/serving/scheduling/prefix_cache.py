"""Prefix reuse for agent loops: caches of recent prompts, cut on a fixed token grid, with a byte budget.

An agent re-sends its whole conversation every turn with a few new messages at the end, so most of each prompt
was already prefilled one turn earlier. The store keeps, per recent conversation, the model cache of its prompt
up to a grid point, and a new request starts its prefill from the longest stored prefix it matches.

**Why a grid.** Attention KV can be cut anywhere, but a Gated DeltaNet layer summarises its whole history in
one recurrent state that cannot be rewound: a prefix is only reusable where a snapshot of that state was taken.
And reuse must give *exactly* the cold-start tokens, bit for bit: so every prefill (cold or warm) runs in
chunks that end on the same absolute grid (multiples of `grid` tokens), and snapshots are taken only at grid
points of such prefills — never from decode-time commits, whose floating-point path differs (batched, padded).
A warm start at grid point `g` then runs exactly the forwards the cold start ran after `g`, on identical inputs.

**What is kept.** An entry holds one row of KV for its prompt up to its last grid point `L` (and the recurrent
state there), plus recurrent snapshots at earlier grid points every `snapshot_interval` tokens (hybrid models:
branches of a conversation, e.g. the same system prompt and tools with different user turns, resume there).
Dense models resume at any grid point of an entry. An entry whose tokens a newer prompt extends
is superseded by the newer one (which inherits its snapshots), so an agent's conversation is one growing entry.

**Scoped.** Entries belong to a scope (the API key a request came with, `clover.serving.request_context`): a
request reuses only its own scope's prefixes, so neither its `cached_tokens` nor its time to first token tells a
client anything about another key's prompts. Without API keys every request has the one scope.

**Stored as shared blocks.** Where the runner's cache can be cut into blocks of KV (`kv_block`: the torch
runner), an entry is a chain of `grid`-token blocks that entries share (`clover.serving.scheduling.prefix_blocks`): an
agent's next turn stores only its new blocks, and conversations of one API key that start with the same system prompt
and tools hold that start once. A `find` assembles the request's own contiguous KV from the blocks (one copy: the
request's buffers are allocated once at about their final size, `CloverCache.expect`, and grow only past it).
Elsewhere (the llama.cpp runner: an entry is its prefix's cells saved to host memory, written back into a new row
on a `find`) an entry is the runner's own copy (`prefix(length, snapshot, copy=True)`). At least one prompt token
is always left to prefill (its logits start decoding).

**Budget.** `budget_bytes` of KV blocks and snapshots, each storage counted once however many entries hold it
(`storages`): everything the store holds. Over budget, the least recently used entry gives memory back leaves
first: a block chain is cut back to its previous resumable point, one point at a time, so its start (the system
prompt and tools the next conversation may send again) goes last; an entry that cannot be cut is dropped whole.
The snapshots a prefill in flight has taken count too (`hold`): a long prompt on a hybrid model snapshots every
grid point on its way (a 32k-token prompt at a 256-token grid, 128 of them: ~8 GB on the 35B preset), and they
live until its prefill ends. Stored entries make room for them, and the prefill keeps at most a budget's worth
(`SnapshotBudget`: it thins its earlier snapshots to every other one when the next would not fit, always keeping
the newest). One scheduler thread owns the store: it is not thread-safe.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Hashable

from clover.engine.runner import RunnerCache, StoredPrefix
from clover.serving.scheduling.prefix_blocks import BlockTable

logger = logging.getLogger(__name__)


def chain_hashes(tokens: list[int], grid: int, upto: int, scope: Hashable = None) -> list[int]:
    """`h[k]` identifies `tokens[:(k + 1) * grid]` within `scope`, for every grid point `<= upto`."""
    out, h = [], hash(("scope", scope))
    for end in range(grid, upto + 1, grid):
        h = hash((h, tuple(tokens[end - grid : end])))
        out.append(h)
    return out


@dataclass
class _Entry:
    tokens: list[int]  # the cached prefix; len == cache.length == a grid multiple
    cache: StoredPrefix  # one row
    states: dict[int, Any]  # grid point -> the cache's snapshot (hybrid models; includes len(tokens))
    hashes: list[int]
    scope: Hashable = None  # whose prompt it is (an API key's index): only requests of that scope reuse it
    points: list[int] = field(default_factory=list)  # grid points this entry can resume at


@dataclass
class Reuse:
    """A prefix found in the store: `length` prompt tokens already in `cache` (the request's own copy of the
    entry's blocks, or the runner's new row: see the module docstring)."""

    length: int
    cache: RunnerCache
    states: dict[int, Any]  # snapshots at grid points <= length (inherited by the next entry)


@dataclass
class PrefixCacheStats:
    queries: int = 0
    hits: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    inserts: int = 0
    evictions: int = 0  # entries dropped
    cuts: int = 0  # entries cut back to an earlier point (their last blocks freed)


class PrefixCache:
    def __init__(self, grid: int, budget_bytes: int, recurrent: bool, snapshot_interval: int | None = None) -> None:
        if grid < 1:
            raise ValueError(f"prefix cache grid must be >= 1 token, got {grid}")
        interval = grid if snapshot_interval is None else snapshot_interval
        if interval < grid or interval % grid:
            raise ValueError(f"snapshot_interval must be a multiple of the grid ({grid}), got {interval}")
        self.grid, self.budget_bytes, self.recurrent, self.snapshot_interval = grid, budget_bytes, recurrent, interval
        self.entries: OrderedDict[int, _Entry] = OrderedDict()  # LRU order: oldest first
        self.index: dict[int, dict[int, _Entry]] = {}  # chain hash at a resumable point -> entries
        self.blocks = BlockTable()  # the KV blocks that entries' chains share (caches with `kv_block`)
        self.stats = PrefixCacheStats()
        self.memory_bytes = 0
        self.in_flight_bytes = 0  # snapshots held by prefills in flight (`hold`), not stored yet

    # -- what to snapshot while prefilling --------------------------------------------------------------------
    def last_point(self, prompt_len: int) -> int:
        """The grid point an entry for this prompt ends at (its KV and state there are stored)."""
        return prompt_len // self.grid * self.grid

    def wants_snapshot(self, position: int, prompt_len: int) -> bool:
        """Whether the prefill should snapshot the recurrent state after the chunk ending at `position`."""
        return self.recurrent and position > 0 and position % self.grid == 0 and (
            position % self.snapshot_interval == 0 or position == self.last_point(prompt_len))

    def hold(self, nbytes: int) -> None:
        """`nbytes` more (fewer, when negative) of snapshots held by prefills in flight; stored entries are evicted
        (least recently used first) so that they and the store stay within the budget together."""
        self.in_flight_bytes += nbytes
        if nbytes > 0 and self.memory_bytes + self.in_flight_bytes > self.budget_bytes:
            self._evict()

    # -- find -------------------------------------------------------------------------------------------------
    def find(self, tokens: list[int], scope: Hashable = None) -> Reuse | None:
        """The longest stored prefix of `tokens` among the entries of `scope` (another scope's prompts are never
        reused: a hit would tell a client that another one sent that prefix), or None."""
        self.stats.queries += 1
        self.stats.queried_tokens += len(tokens)
        hashes = chain_hashes(tokens, self.grid, (len(tokens) - 1) // self.grid * self.grid, scope)
        for k in range(len(hashes) - 1, -1, -1):
            g = (k + 1) * self.grid
            for entry in reversed(list(self.index.get(hashes[k], {}).values())):
                if entry.scope != scope or entry.tokens[:g] != tokens[:g]:  # a collision: never trust a hash alone
                    continue
                self.entries.move_to_end(id(entry))
                self.stats.hits += 1
                self.stats.hit_tokens += g
                cache = entry.cache.prefix(g, entry.states.get(g))
                return Reuse(g, cache, {p: s for p, s in entry.states.items() if p <= g})
        return None

    def entries_of(self, scope: Hashable) -> int:
        """Entries of `scope` (readable from another thread: the entries are copied by one C call)."""
        return sum(1 for entry in list(self.entries.values()) if entry.scope == scope)

    # -- insert / evict ---------------------------------------------------------------------------------------
    def insert(self, tokens: list[int], cache: RunnerCache, states: dict[int, Any], scope: Hashable = None) -> None:
        """Store the prompt `tokens` of `scope` whose prefill left `cache` (one row, `len(tokens)` positions, not
        stored: the KV up to the last grid point is copied out) and the snapshots `states` taken on the way (and
        inherited from the entry it resumed from)."""
        end = self.last_point(len(tokens))
        if end == 0 or cache.batch_size != 1 or cache.length != len(tokens):
            return
        if self.recurrent and end not in states:
            if end != len(tokens):
                logger.warning("prefix cache: no recurrent snapshot at %d; prompt not stored", end)
                return
            states = {**states, end: cache.snapshot()}
        kept = {p: s for p, s in states.items() if p <= end}
        hashes = chain_hashes(tokens, self.grid, end, scope)
        # KV kept apart from the request's: shared blocks where the cache can be cut into them (the blocks this
        # entry shares with stored ones are not copied again), else the runner's own copy; the state at `end` is
        # the snapshot itself
        if hasattr(cache, "kv_block"):
            # room first for the blocks it copies: the store stays within its budget even while it copies them
            fresh = self.blocks.new_bytes(cache, tokens, hashes, self.grid, end, scope)
            self.hold(fresh)
            stored = self.blocks.chain(cache, tokens, hashes, self.grid, end, scope)
            self.in_flight_bytes -= fresh
        else:
            stored = cache.prefix(end, kept.get(end), copy=True)
        entry = _Entry(tokens[:end], stored, kept, hashes, scope)
        # entries that this one extends are superseded: inherit their snapshots, drop them
        for k, h in enumerate(entry.hashes):
            for old in list(self.index.get(h, {}).values()):
                if (old.scope == scope and len(old.tokens) == (k + 1) * self.grid
                        and old.tokens == entry.tokens[: len(old.tokens)]):
                    for p, s in old.states.items():
                        entry.states.setdefault(p, s)
                    self._remove(old)
        grid_points = [(k + 1) * self.grid for k in range(len(entry.hashes))]
        entry.points = sorted(entry.states) if self.recurrent else grid_points
        for p in entry.points:
            self.index.setdefault(entry.hashes[p // self.grid - 1], {})[id(entry)] = entry
        self.entries[id(entry)] = entry
        self.stats.inserts += 1
        self._recount()
        if self.memory_bytes + self.in_flight_bytes > self.budget_bytes:
            self._evict()

    def _evict(self) -> None:
        """Free the least recently used entry's memory, its leaves first, until within budget: an entry stored as
        a block chain is cut back to its previous resumable point, one at a time (its first blocks, a system
        prompt and tools that the next conversation may share, go last); it is dropped when nothing is left to
        cut, or when every storage it still holds is held by another entry too (cutting it frees nothing). One
        pass counts each storage's holders; a cut or an eviction then subtracts the storages only it held (a
        recount per step would be quadratic)."""
        holders: dict[int, int] = {}
        for entry in self.entries.values():
            for ptr in _storages(entry):
                holders[ptr] = holders.get(ptr, 0) + 1
        while self.memory_bytes + self.in_flight_bytes > self.budget_bytes and self.entries:
            entry = next(iter(self.entries.values()))
            before = _storages(entry)
            if hasattr(entry.cache, "trim") and len(entry.points) > 1 and any(holders[p] == 1 for p in before):
                self._cut(entry, entry.points[-2])
                after = _storages(entry)
            else:
                self._remove(entry)
                self.stats.evictions += 1
                after = {}
            for ptr, nbytes in before.items():
                if ptr not in after:
                    holders[ptr] -= 1
                    if not holders[ptr]:
                        self.memory_bytes -= nbytes

    def _cut(self, entry: _Entry, end: int) -> None:
        """Cut `entry` back to its resumable point `end` (its blocks, snapshots and index points past it go)."""
        for p in entry.points:
            if p > end:
                self._unindex(entry, p)
        entry.cache.trim(end)
        entry.tokens, entry.hashes = entry.tokens[:end], entry.hashes[: end // self.grid]
        entry.states = {p: s for p, s in entry.states.items() if p <= end}
        entry.points = [p for p in entry.points if p <= end]
        self.stats.cuts += 1

    def _remove(self, entry: _Entry) -> None:
        self.entries.pop(id(entry), None)
        for p in entry.points:
            self._unindex(entry, p)

    def _unindex(self, entry: _Entry, point: int) -> None:
        h = entry.hashes[point // self.grid - 1]
        bucket = self.index.get(h)
        if bucket is not None:
            bucket.pop(id(entry), None)
            if not bucket:
                del self.index[h]

    def _recount(self) -> None:
        """Bytes of every tensor held, each storage once (snapshots are shared between entries)."""
        seen: dict[int, int] = {}
        for entry in self.entries.values():
            seen.update(_storages(entry))
        self.memory_bytes = sum(seen.values())

    def clear(self) -> None:
        self.entries.clear()
        self.index.clear()
        self.blocks = BlockTable()
        self.memory_bytes = 0


class SnapshotBudget:
    """The snapshots one prefill takes on its way, counted against the store's budget (`PrefixCache.hold`): when
    the next would not fit beside them, every other earlier one is dropped (the grid of resumable points
    coarsens, the newest always kept) until it does; one larger than the whole budget is not kept."""

    def __init__(self, store: PrefixCache) -> None:
        self.store = store
        self.taken: dict[int, int] = {}  # grid point -> bytes, of the snapshots this prefill took (held)

    @property
    def held_bytes(self) -> int:
        return sum(self.taken.values())

    def add(self, states: dict[int, Any], point: int, cache: RunnerCache) -> None:
        """Snapshot `cache` at `point` into `states` (the prefill's snapshots), within the budget."""
        snapshot = cache.snapshot()
        nbytes = snapshot_bytes(cache, snapshot)
        budget = self.store.budget_bytes
        if nbytes > budget:
            return
        while self.taken and self.held_bytes + nbytes > budget:
            for p in sorted(self.taken)[-2::-2]:  # every other one, counting back from the newest (kept)
                states.pop(p, None)
                self.store.hold(-self.taken.pop(p))
            if len(self.taken) == 1 and self.held_bytes + nbytes > budget:  # only the newest was left
                p = next(iter(self.taken))
                states.pop(p, None)
                self.store.hold(-self.taken.pop(p))
        states[point] = snapshot
        self.taken[point] = nbytes
        self.store.hold(nbytes)

    def release(self) -> None:
        """The prefill ended (its snapshots stored with its entry, or dropped): they are no longer in flight."""
        self.store.hold(-self.held_bytes)
        self.taken.clear()


def snapshot_bytes(cache: RunnerCache, snapshot: Any) -> int:
    """Bytes `snapshot` holds beyond `cache` itself (0 where the runner cannot tell, or has no recurrent state)."""
    storages = getattr(cache, "storages", None)
    if snapshot is None or storages is None:
        return 0
    own = storages()
    return sum(n for key, n in storages([snapshot]).items() if key not in own)


def _storages(entry: _Entry) -> dict[Hashable, int]:
    """The storages an entry holds (its cache's and snapshots'), by key, each once."""
    return entry.cache.storages(entry.states.values())
