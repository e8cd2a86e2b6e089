"""`CloverCache`: what decoding keeps between forward passes.

* attention layers: keys and values of every committed token (grows with the context);
* Gated DeltaNet layers: the recurrent state `S` (`[N, Hv, dk, dv]`, fp32) and the last `K-1` conv inputs —
  a fixed size, whatever the context length;
* per sequence: which cached positions are real tokens (left padding of batched prompts is not) and the next
  position id.

Rows are sequences; `select` keeps a subset (finished requests leave a batch), `concat` stacks caches of
different lengths into one batch (a request joins a running batch: the shorter attention KV is left-padded
and the padding marked invalid), `prefix` cuts a cache back to its first positions, `snapshot` copies the
DeltaNet states and `storages` names the memory held (prefix reuse: the runner cache interface of
`clover.engine.runner`), `clone` copies a cache, `memory_bytes` reports what it holds.
`mark` + `rewind` undo part of one forward's clean tokens (exact mode's rejected drafts), `compact` squeezes out
the holes rewinding leaves in a batch.

Invariant that makes sharing safe: a cache never writes inside positions it already holds — attention layers
only write past `length` (appends; a forward's query keys/values, which the next append overwrites; an exact-size
buffer reallocates), DeltaNet layers replace their tensors — so a
`prefix` may share tensors with the cache it was cut from. The one exception is `rewind`, which gives back
positions written by the forward since `mark` (no `prefix` is ever cut from those).

(Over the 450-line mark: the attention and DeltaNet layer caches and the batch operations over both stay in one
file because every operation — select, concat, prefix, rewind, compact — must treat the two kinds alike.)
"""

from __future__ import annotations

from typing import Iterable

import torch

from clover.config import FULL_ATTENTION, CloverConfig
from clover.ops.delta_rule import chunk_gated_delta_rule

# per layer: (state, conv) of a DeltaNet layer, None for an attention layer (or an empty DeltaNet layer)
RecurrentSnapshot = list["tuple[torch.Tensor, torch.Tensor] | None"]


class AttentionLayerCache:
    """K/V buffers `[N, Hkv, capacity, D]` that grow by a quarter (or straight to `expected`, the length the
    sequence is expected to reach: `CloverCache.expect`), so appending a block is amortised O(block) — a position
    is copied about four times on average — and at most a quarter of a buffer is unused (doubling left up to half:
    ~170 MiB of the default model's fp32 KV at 8k tokens)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0
        self.expected = 0

    def reserve(self, t: int, n: int, heads: int, k_dim: int, v_dim: int,
                like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers `[n, heads, capacity, k_dim / v_dim]`, grown if needed so that `t` positions fit past
        `length` (new ones take `like`'s dtype and device)."""
        need = self.length + t
        if self.k is None or need > self.k.shape[2]:
            capacity = self.expected if self.expected >= need else max(-(-(need + need // 4) // 64) * 64, 64)
            new_k = like.new_empty(n, heads, capacity, k_dim)
            new_v = like.new_empty(n, heads, capacity, v_dim)
            if self.k is not None:
                new_k[:, :, : self.length] = self.k[:, :, : self.length]
                new_v[:, :, : self.length] = self.v[:, :, : self.length]
            self.k, self.v = new_k, new_v
        return self.k, self.v

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n, h, t, d = k.shape
        self.reserve(t, n, h, d, v.shape[-1], k)
        self.k[:, :, self.length : self.length + t] = k
        self.v[:, :, self.length : self.length + t] = v
        self.length += t

    def extend(self, k: torch.Tensor, v: torch.Tensor, commit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of the cache followed by `k, v` (`[N, Hkv, T, D]`), as views of the buffer: the first
        `commit` of the T positions are appended, the rest (query tokens, never cached) are written past
        `length`, where the next append overwrites them. No concatenation per forward."""
        t = k.shape[2]
        self.append(k, v)  # grows the buffer once for all T positions
        self.length -= t - commit
        end = self.length + t - commit
        return self.k[:, :, :end], self.v[:, :, :end]

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.k is None or self.length == 0:
            return None
        return self.k[:, :, : self.length], self.v[:, :, : self.length]

    def select(self, rows: torch.Tensor) -> None:
        if self.k is not None:
            self.k, self.v = self.k[rows], self.v[rows]

    def truncate(self, length: int) -> None:
        """Forget positions `>= length` (the buffer keeps its capacity: the next append overwrites them)."""
        self.length = min(self.length, length)

    def gather(self, columns: torch.Tensor) -> None:
        """Keep, per row, the positions `columns` `[N, L]` (in that order): exact-size new buffers."""
        if self.k is not None:
            index = columns[:, None, :, None]
            self.k = self.k.gather(2, index.expand(-1, self.k.shape[1], -1, self.k.shape[3]))
            self.v = self.v.gather(2, index.expand(-1, self.v.shape[1], -1, self.v.shape[3]))
            self.length = columns.shape[1]

    def drop_front(self, n: int) -> None:
        """Forget the first `n` positions (columns of left padding no row needs any more)."""
        if self.k is not None and n:
            self.k, self.v = self.k[:, :, n:], self.v[:, :, n:]
            self.length -= n

    def prefix(self, length: int, copy: bool = False) -> "AttentionLayerCache":
        """The first `length` positions, exact size (appending to it reallocates): a view, or a copy."""
        new = AttentionLayerCache()
        if self.k is not None and length:
            k, v = self.k[:, :, :length], self.v[:, :, :length]
            new.k, new.v = (k.clone(), v.clone()) if copy else (k, v)
            new.length = length
        return new

    def clone(self) -> "AttentionLayerCache":
        new = AttentionLayerCache()
        kv = self.keys_values()
        if kv is not None:
            new.append(kv[0].clone(), kv[1].clone())
        return new

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.k is None else [self.k, self.v]

    def memory_bytes(self) -> int:
        kv = self.keys_values()
        return 0 if kv is None else sum(t.numel() * t.element_size() for t in kv)

    @staticmethod
    def concat(layers: list["AttentionLayerCache"], lengths: list[int], sizes: list[int]) -> "AttentionLayerCache":
        """Rows of several caches, each left-padded with zeros to the longest (`lengths`: each cache's length,
        `sizes`: its rows). An empty cache (a request whose prompt opened its first block whole) is all padding."""
        longest = max(lengths)
        held = next((layer.keys_values() for layer in layers if layer.k is not None), None)
        if held is None:
            return AttentionLayerCache()
        ks, vs = [], []
        for layer, length, size in zip(layers, lengths, sizes):
            kv = layer.keys_values()
            k, v = kv if kv is not None else (held[0].new_zeros(size, *held[0].shape[1:2], 0, held[0].shape[3]),
                                              held[1].new_zeros(size, *held[1].shape[1:2], 0, held[1].shape[3]))
            pad = longest - length
            ks.append(torch.nn.functional.pad(k, (0, 0, pad, 0)) if pad else k)
            vs.append(torch.nn.functional.pad(v, (0, 0, pad, 0)) if pad else v)
        new = AttentionLayerCache()
        new.k, new.v, new.length = torch.cat(ks), torch.cat(vs), longest
        return new


class DeltaNetLayerCache:
    """Recurrent state and conv window of one Gated DeltaNet layer (zeros = empty history).

    While `recording` (between `CloverCache.mark` and `rewind`), the layer keeps in `undo` what the forward's
    clean tokens did to it: the state before them, their conv inputs, and either their `k, v, g, beta` (the chunked
    rule: enough to recompute the state over any prefix of them without running the model again) or, where the C++
    decoding step stepped them, the state after each of them (`steps`)."""

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None  # [N, Hv, dk, dv], fp32
        self.conv: torch.Tensor | None = None  # [N, C, K-1], the last K-1 inputs of the causal conv
        self.recording = False
        # (state before, conv inputs [N, C, K-1 + T] history first, k [N, H, T, dk], v, g [N, H, T], beta)
        self.undo: tuple[torch.Tensor, ...] | None = None
        self.steps: torch.Tensor | None = None  # [T, N, Hv, dk, dv]: the state after each recorded token, where
        # the C++ decoding step stepped them (`GatedDeltaNet._fused_step`); None where the chunked rule ran. The state
        # a rewind leaves is a view of it, so the T slots live until the next forward replaces the state (a prefix
        # shared from this cache holds them too, and `CloverCache.storages` counts them)

    def record(self, state: torch.Tensor, full: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor) -> None:
        """Called by the layer for a forward's clean tokens run by the chunked rule (a no-op unless recording)."""
        if self.recording:
            self._record((state, full, k, v, g, beta))

    def record_steps(self, state: torch.Tensor, full: torch.Tensor, steps: torch.Tensor) -> None:
        """Called by the C++ decoding step for a forward's clean tokens, with the state after each (`steps`)."""
        if self.recording:
            self._record((state, full), steps)

    def _record(self, undo: tuple[torch.Tensor, ...], steps: torch.Tensor | None = None) -> None:
        if self.undo is not None:
            raise RuntimeError("only one forward can run between CloverCache.mark and rewind")
        self.undo, self.steps = undo, steps

    def rewind(self, keep: torch.Tensor, fed: torch.Tensor) -> None:
        """Keep each row's first `keep[r]` of the `fed[r]` clean tokens of the recorded forward.

        Where the C++ decoding step stepped the tokens, the state after the kept ones is the one it wrote then
        (`steps`): the bits a block-size-1 step gives, at no cost. Else it is recomputed from the state before the
        forward by the chunked causal rule over the recorded `k, v, g, beta`, with `g = beta = 0` from `keep[r]` on
        (exactly the identity step: `S * exp(0) + k * 0`): one state-only pass of the rule over at most `T` tokens
        per layer — no projections, no other layer — and only `O(T)` extra memory, where per-token states would need
        `T` states of `dk x dv` per head. Rows that keep everything get, bit for bit, the state the forward computed
        (the same call on the same inputs). The conv window is the `K-1` inputs that end at the last kept token."""
        state0, full = self.undo[:2]
        if self.steps is not None:
            counts = keep.tolist()
            if len(set(counts)) == 1:  # every row keeps as many (one row): a view, no copy
                self.state = state0 if counts[0] == 0 else self.steps[counts[0] - 1]
            else:
                self.state = torch.stack([state0[r] if j == 0 else self.steps[j - 1, r] for r, j in enumerate(counts)])
        elif bool((keep < fed).any()):
            k, v, g, beta = self.undo[2:]
            t = k.shape[2]
            kept = (torch.arange(t, device=keep.device)[None] < keep[:, None])[:, None].to(g.dtype)  # [N, 1, T]
            _, self.state, _ = chunk_gated_delta_rule(None, k, v, g * kept, beta * kept, state0,
                                                      chunk_size=min(t, 64))
        k1 = self.conv.shape[2]  # the window the forward left: K-1 inputs
        index = (keep[:, None] + torch.arange(k1, device=keep.device)[None])[:, None].expand(-1, full.shape[1], -1)
        self.conv = full.gather(2, index)
        self.recording, self.undo, self.steps = False, None, None

    def select(self, rows: torch.Tensor) -> None:
        if self.state is not None:
            self.state, self.conv = self.state[rows], self.conv[rows]

    def clone(self) -> "DeltaNetLayerCache":
        new = DeltaNetLayerCache()
        if self.state is not None:
            new.state, new.conv = self.state.clone(), self.conv.clone()
        return new

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.state is None else [self.state, self.conv]

    def memory_bytes(self) -> int:
        if self.state is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.state, self.conv))

    @staticmethod
    def concat(layers: list["DeltaNetLayerCache"], sizes: list[int]) -> "DeltaNetLayerCache":
        """Rows of several caches (`sizes`: the rows of each); an empty one joins as zeros, the empty history."""
        new = DeltaNetLayerCache()
        held = next((layer for layer in layers if layer.state is not None), None)
        if held is not None:
            new.state = torch.cat([layer.state if layer.state is not None else
                                   held.state.new_zeros(size, *held.state.shape[1:])
                                   for layer, size in zip(layers, sizes)])
            new.conv = torch.cat([layer.conv if layer.conv is not None else
                                  held.conv.new_zeros(size, *held.conv.shape[1:])
                                  for layer, size in zip(layers, sizes)])
        return new


class CloverCache:
    def __init__(self, config: CloverConfig, batch_size: int, device: torch.device | str = "cpu") -> None:
        self.layers: list[AttentionLayerCache | DeltaNetLayerCache] = [
            AttentionLayerCache() if t == FULL_ATTENTION else DeltaNetLayerCache() for t in config.layer_types]
        self.batch_size = batch_size
        self.valid = torch.ones(batch_size, 0, dtype=torch.bool, device=device)  # [N, length]
        self.next_position = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.marked: int | None = None  # `length` at `mark()`, until `rewind`

    @property
    def length(self) -> int:
        """Cached positions per row, padding included."""
        return self.valid.shape[1]

    def expect(self, positions: int) -> None:
        """The sequence will reach about `positions` cached positions (its prompt and answer): each attention
        layer's next allocation takes that size at once, rather than growing by steps past it."""
        for layer in self.layers:
            if isinstance(layer, AttentionLayerCache):
                layer.expected = positions

    def kv_block(self, start: int, end: int) -> torch.Tensor:
        """A copy of every attention layer's keys and values at positions `[start, end)`: `[A, N, Hkv, end - start,
        Dk + Dv]` for the `A` attention layers, keys first on the last axis (a prefix-cache block:
        clover.serving.scheduling.prefix_blocks; `of_blocks` reads them back)."""
        parts = [torch.cat([layer.k[:, :, start:end], layer.v[:, :, start:end]], dim=-1)
                 for layer in self.layers if isinstance(layer, AttentionLayerCache)]
        return torch.stack(parts) if parts else torch.empty(0)

    def of_blocks(self, blocks: list[torch.Tensor], length: int, key_dim: int,
                  snapshot: RecurrentSnapshot | None = None) -> "CloverCache":
        """A one-row cache with this cache's layers, holding the `length` positions of `blocks` (`kv_block`s, in
        order; exact-size buffers, so the first append reallocates) and, in DeltaNet layers, `snapshot`'s states."""
        new = CloverCache.__new__(CloverCache)
        new.layers, attention = [], 0
        for i, layer in enumerate(self.layers):
            if isinstance(layer, AttentionLayerCache):
                cut, attention = AttentionLayerCache(), attention + 1
                if blocks:
                    kv = torch.cat([block[attention - 1] for block in blocks], dim=2)
                    cut.k, cut.v, cut.length = kv[..., :key_dim], kv[..., key_dim:], kv.shape[2]
            else:
                cut = DeltaNetLayerCache()
                if snapshot is not None and snapshot[i] is not None:
                    cut.state, cut.conv = snapshot[i]
            new.layers.append(cut)
        new.batch_size = 1
        new.valid = torch.ones(1, length, dtype=torch.bool, device=self.valid.device)
        new.next_position = torch.full((1,), length, dtype=torch.long, device=self.valid.device)
        new.marked = None
        return new

    def past_valid(self) -> torch.Tensor | None:
        return self.valid if self.length else None

    def commit(self, clean_valid: torch.Tensor) -> None:
        """Record `[N, T]` newly cached positions (called once per forward, after the layers wrote theirs)."""
        self.valid = torch.cat([self.valid, clean_valid], dim=1)
        self.next_position = self.next_position + clean_valid.sum(1)

    def select(self, rows: torch.Tensor | list[int]) -> None:
        """Keep `rows` (in this order). Leading columns that are padding in every kept row are dropped, so the
        KV does not keep the padding of requests that have left."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.valid.device)
        for layer in self.layers:
            layer.select(rows)
        self.valid, self.next_position = self.valid[rows], self.next_position[rows]
        self.batch_size = len(rows)
        if self.length and len(rows):
            unused = int(self.valid.any(0).int().argmax()) if bool(self.valid.any()) else self.length
            if unused:
                for layer in self.layers:
                    if isinstance(layer, AttentionLayerCache):
                        layer.drop_front(unused)
                self.valid = self.valid[:, unused:]

    def mark(self) -> None:
        """Remember this point: the clean tokens of the next forward (one forward) can be partly undone by
        `rewind`. DeltaNet layers start recording what that forward does to them."""
        self.marked = self.length
        for layer in self.layers:
            if isinstance(layer, DeltaNetLayerCache):
                layer.recording, layer.undo = True, None

    def rewind(self, keep: torch.Tensor) -> None:
        """Undo the forward since `mark` except each row's first `keep[r]` clean tokens (`[N]`, at most the row's
        real tokens of that forward, which must come first in it: right padding, if any). Afterwards the cache
        is what a forward of only the kept tokens would have left: attention positions beyond them are marked
        invalid and the common tail cut (the buffer is reused), positions continue after them, DeltaNet states
        are recomputed (`DeltaNetLayerCache.rewind`). Rows that keep different counts leave holes (invalid
        columns, never attended to); `compact` removes them once they are a quarter of the cache."""
        if self.marked is None:
            raise RuntimeError("rewind needs a mark() before the forward it undoes")
        start, keep = self.marked, keep.to(self.valid.device)
        tail = self.valid[:, start:]
        kept = tail & (torch.arange(tail.shape[1], device=keep.device)[None] < keep[:, None])
        fed = tail.sum(1)
        self.next_position = self.next_position - (fed - kept.sum(1))
        length = start + int(keep.max()) if len(keep) else start
        self.valid = torch.cat([self.valid[:, :start], kept], dim=1)[:, :length]
        for layer in self.layers:
            if isinstance(layer, AttentionLayerCache):
                layer.truncate(length)
            elif layer.undo is not None:
                layer.rewind(keep, fed)
            else:
                layer.recording = False
        self.marked = None
        holes = self.length - int(self.valid.sum(1).max()) if self.length else 0
        if 4 * holes > self.length:
            self.compact()

    def compact(self) -> None:
        """Move each row's valid positions to the right end of the shortest rectangle that holds them (order kept),
        so invalid columns in the middle (holes left by `rewind`) stop costing memory and attention. Attention
        reads a set of keys whose positions are baked in by RoPE, so this changes no result. Costs one copy of
        the KV: `rewind` calls it only when holes exceed a quarter of the length, so it is amortised."""
        width = int(self.valid.sum(1).max())
        # a stable sort of valid (False first) lists each row's invalid columns, then its valid ones in order
        columns = torch.sort(self.valid.int(), dim=1, stable=True).indices[:, self.length - width:]
        for layer in self.layers:
            if isinstance(layer, AttentionLayerCache):
                layer.gather(columns)
        self.valid = self.valid.gather(1, columns)

    @classmethod
    def concat(cls, caches: list["CloverCache"]) -> "CloverCache":
        """One batch with the rows of `caches`, in order. Histories of different lengths are aligned on the right:
        the shorter attention KV is left-padded (zeros, marked invalid in `valid`, so never attended to); DeltaNet
        states are per row and need no padding. Positions stay per row (`next_position`)."""
        if not caches:
            raise ValueError("concat needs at least one cache")
        lengths, sizes = [c.length for c in caches], [c.batch_size for c in caches]
        longest = max(lengths)
        new = cls.__new__(cls)
        new.layers = []
        for i, layer in enumerate(caches[0].layers):
            group = [c.layers[i] for c in caches]
            if isinstance(layer, AttentionLayerCache):
                new.layers.append(AttentionLayerCache.concat(group, lengths, sizes))
            else:
                new.layers.append(DeltaNetLayerCache.concat(group, sizes))
        new.valid = torch.cat([torch.nn.functional.pad(c.valid, (longest - c.length, 0), value=False)
                               for c in caches])
        new.next_position = torch.cat([c.next_position for c in caches])
        new.batch_size = sum(c.batch_size for c in caches)
        new.marked = None
        return new

    @property
    def has_recurrent(self) -> bool:
        return any(isinstance(layer, DeltaNetLayerCache) for layer in self.layers)

    def snapshot(self) -> RecurrentSnapshot | None:
        """Copies of every DeltaNet layer's state and conv window now (to resume from this point later); None
        without DeltaNet layers (attention KV can be cut at any length)."""
        if not self.has_recurrent:
            return None
        return [(layer.state.clone(), layer.conv.clone())
                if isinstance(layer, DeltaNetLayerCache) and layer.state is not None else None
                for layer in self.layers]

    def prefix(self, length: int, snapshot: RecurrentSnapshot | None = None, copy: bool = False) -> "CloverCache":
        """A cache holding the first `length` cached positions of every row.

        Attention KV is sliced: views sharing memory with this cache, or exact-size copies (`copy`, to keep them
        apart from buffers this cache will grow in). A DeltaNet layer summarises its whole history in one state,
        which cannot be cut: give the states at `length` as `snapshot` (a `snapshot()` taken when the
        cache held `length` positions; used as given, not copied), or cut nothing (`length == self.length`, the
        current states are shared)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"prefix length must be in [0, {self.length}], got {length}")
        if self.has_recurrent and snapshot is None and length != self.length:
            raise ValueError(f"cutting a cache with DeltaNet layers to {length} of {self.length} positions needs "
                             "their recurrent states at that point (`snapshot=`)")
        new = CloverCache.__new__(CloverCache)
        new.layers = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, AttentionLayerCache):
                new.layers.append(layer.prefix(length, copy))
                continue
            cut = DeltaNetLayerCache()
            state = snapshot[i] if snapshot is not None else (
                (layer.state, layer.conv) if layer.state is not None else None)
            if state is not None:
                cut.state, cut.conv = state
            new.layers.append(cut)
        new.batch_size = self.batch_size
        new.valid = self.valid[:, :length]
        new.next_position = new.valid.sum(1)
        new.marked = None
        return new

    def clone(self) -> "CloverCache":
        new = CloverCache.__new__(CloverCache)
        new.layers = [layer.clone() for layer in self.layers]
        new.batch_size = self.batch_size
        new.valid, new.next_position = self.valid.clone(), self.next_position.clone()
        new.marked = None
        return new

    def storages(self, snapshots: Iterable[RecurrentSnapshot | None] = ()) -> dict[int, int]:
        """The memory this cache and `snapshots` of it hold: storage data pointer -> bytes, each storage once
        (tensors shared between caches share a key)."""
        tensors = [t for layer in self.layers for t in layer.tensors()]
        tensors += [t for snap in snapshots if snap is not None for pair in snap if pair is not None for t in pair]
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}

    def memory_bytes(self) -> dict[str, int]:
        attention = sum(l.memory_bytes() for l in self.layers if isinstance(l, AttentionLayerCache))
        recurrent = sum(l.memory_bytes() for l in self.layers if isinstance(l, DeltaNetLayerCache))
        return {"attention_kv": attention, "recurrent_state": recurrent, "total": attention + recurrent}
