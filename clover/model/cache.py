"""`CloverCache`: what decoding keeps between forward passes.

* attention layers: keys and values of every committed token (grows with the context);
* Gated DeltaNet layers: the recurrent state `S` (`[N, Hv, dk, dv]`, fp32) and the last `K-1` conv inputs —
  a fixed size, whatever the context length;
* per sequence: which cached positions are real tokens (left padding of batched prompts is not) and the next
  position id.

Rows are sequences; `select` keeps a subset (finished requests leave a batch), `concat` stacks caches of
different lengths into one batch (a request joins a running batch: the shorter attention KV is left-padded
and the padding marked invalid), `prefix` cuts a cache back to its first positions and `snapshot_recurrent`
copies the DeltaNet states (prefix reuse), `clone` copies a cache, `memory_bytes` reports what it holds.

Invariant that makes sharing safe: a cache never writes inside positions it already holds — attention layers
only append past `length` (an exact-size buffer reallocates), DeltaNet layers replace their tensors — so a
`prefix` may share tensors with the cache it was cut from.
"""

from __future__ import annotations

import torch

from clover.config import FULL_ATTENTION, CloverConfig

# per layer: (state, conv) of a DeltaNet layer, None for an attention layer (or an empty DeltaNet layer)
RecurrentSnapshot = list["tuple[torch.Tensor, torch.Tensor] | None"]


class AttentionLayerCache:
    """K/V buffers `[N, Hkv, capacity, D]` that grow by doubling, so appending a block is amortised O(block)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n, h, t, d = k.shape
        if self.k is None or self.length + t > self.k.shape[2]:
            capacity = max(2 * (self.length + t), 64)
            new_k = k.new_empty(n, h, capacity, d)
            new_v = v.new_empty(n, h, capacity, v.shape[-1])
            if self.k is not None:
                new_k[:, :, : self.length] = self.k[:, :, : self.length]
                new_v[:, :, : self.length] = self.v[:, :, : self.length]
            self.k, self.v = new_k, new_v
        self.k[:, :, self.length : self.length + t] = k
        self.v[:, :, self.length : self.length + t] = v
        self.length += t

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.k is None or self.length == 0:
            return None
        return self.k[:, :, : self.length], self.v[:, :, : self.length]

    def select(self, rows: torch.Tensor) -> None:
        if self.k is not None:
            self.k, self.v = self.k[rows], self.v[rows]

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
    def concat(layers: list["AttentionLayerCache"], lengths: list[int]) -> "AttentionLayerCache":
        """Rows of several caches, each left-padded with zeros to the longest (`lengths`: each cache's length)."""
        longest = max(lengths)
        ks, vs = [], []
        for layer, length in zip(layers, lengths):
            k, v = layer.keys_values()  # every cache being joined holds at least one position
            pad = longest - length
            ks.append(torch.nn.functional.pad(k, (0, 0, pad, 0)) if pad else k)
            vs.append(torch.nn.functional.pad(v, (0, 0, pad, 0)) if pad else v)
        new = AttentionLayerCache()
        new.k, new.v, new.length = torch.cat(ks), torch.cat(vs), longest
        return new


class DeltaNetLayerCache:
    """Recurrent state and conv window of one Gated DeltaNet layer (zeros = empty history)."""

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None  # [N, Hv, dk, dv], fp32
        self.conv: torch.Tensor | None = None  # [N, C, K-1], the last K-1 inputs of the causal conv

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
    def concat(layers: list["DeltaNetLayerCache"]) -> "DeltaNetLayerCache":
        if any(layer.state is None for layer in layers):
            raise ValueError("cannot join a DeltaNet cache without history (an empty cache) into a batch")
        new = DeltaNetLayerCache()
        new.state = torch.cat([layer.state for layer in layers])
        new.conv = torch.cat([layer.conv for layer in layers])
        return new


class CloverCache:
    def __init__(self, config: CloverConfig, batch_size: int, device: torch.device | str = "cpu") -> None:
        self.layers: list[AttentionLayerCache | DeltaNetLayerCache] = [
            AttentionLayerCache() if t == FULL_ATTENTION else DeltaNetLayerCache() for t in config.layer_types]
        self.batch_size = batch_size
        self.valid = torch.ones(batch_size, 0, dtype=torch.bool, device=device)  # [N, length]
        self.next_position = torch.zeros(batch_size, dtype=torch.long, device=device)

    @property
    def length(self) -> int:
        """Cached positions per row, padding included."""
        return self.valid.shape[1]

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

    @classmethod
    def concat(cls, caches: list["CloverCache"]) -> "CloverCache":
        """One batch with the rows of `caches`, in order. Histories of different lengths are aligned on the right:
        the shorter attention KV is left-padded (zeros, marked invalid in `valid`, so never attended to); DeltaNet
        states are per row and need no padding. Positions stay per row (`next_position`)."""
        if not caches:
            raise ValueError("concat needs at least one cache")
        lengths = [c.length for c in caches]
        longest = max(lengths)
        new = cls.__new__(cls)
        new.layers = []
        for i, layer in enumerate(caches[0].layers):
            group = [c.layers[i] for c in caches]
            if isinstance(layer, AttentionLayerCache):
                new.layers.append(AttentionLayerCache.concat(group, lengths))
            else:
                new.layers.append(DeltaNetLayerCache.concat(group))
        new.valid = torch.cat([torch.nn.functional.pad(c.valid, (longest - c.length, 0), value=False)
                               for c in caches])
        new.next_position = torch.cat([c.next_position for c in caches])
        new.batch_size = sum(c.batch_size for c in caches)
        return new

    @property
    def has_recurrent(self) -> bool:
        return any(isinstance(layer, DeltaNetLayerCache) for layer in self.layers)

    def snapshot_recurrent(self) -> RecurrentSnapshot:
        """Copies of every DeltaNet layer's state and conv window now (to resume from this point later)."""
        return [(layer.state.clone(), layer.conv.clone())
                if isinstance(layer, DeltaNetLayerCache) and layer.state is not None else None
                for layer in self.layers]

    def prefix(self, length: int, recurrent: RecurrentSnapshot | None = None, copy: bool = False) -> "CloverCache":
        """A cache holding the first `length` cached positions of every row.

        Attention KV is sliced: views sharing memory with this cache, or exact-size copies (`copy`, to keep them
        apart from buffers this cache will grow in). A DeltaNet layer summarises its whole history in one state,
        which cannot be cut: give the states at `length` as `recurrent` (a `snapshot_recurrent()` taken when the
        cache held `length` positions; used as given, not copied), or cut nothing (`length == self.length`, the
        current states are shared)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"prefix length must be in [0, {self.length}], got {length}")
        if self.has_recurrent and recurrent is None and length != self.length:
            raise ValueError(f"cutting a cache with DeltaNet layers to {length} of {self.length} positions needs "
                             "their recurrent states at that point (`recurrent=`)")
        new = CloverCache.__new__(CloverCache)
        new.layers = []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, AttentionLayerCache):
                new.layers.append(layer.prefix(length, copy))
                continue
            cut = DeltaNetLayerCache()
            state = recurrent[i] if recurrent is not None else (
                (layer.state, layer.conv) if layer.state is not None else None)
            if state is not None:
                cut.state, cut.conv = state
            new.layers.append(cut)
        new.batch_size = self.batch_size
        new.valid = self.valid[:, :length]
        new.next_position = new.valid.sum(1)
        return new

    def clone(self) -> "CloverCache":
        new = CloverCache.__new__(CloverCache)
        new.layers = [layer.clone() for layer in self.layers]
        new.batch_size = self.batch_size
        new.valid, new.next_position = self.valid.clone(), self.next_position.clone()
        return new

    def memory_bytes(self) -> dict[str, int]:
        attention = sum(l.memory_bytes() for l in self.layers if isinstance(l, AttentionLayerCache))
        recurrent = sum(l.memory_bytes() for l in self.layers if isinstance(l, DeltaNetLayerCache))
        return {"attention_kv": attention, "recurrent_state": recurrent, "total": attention + recurrent}
