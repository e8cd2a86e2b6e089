"""`CloverCache`: what decoding keeps between forward passes.

* attention layers: keys and values of every committed token (grows with the context);
* Gated DeltaNet layers: the recurrent state `S` (`[N, Hv, dk, dv]`, fp32) and the last `K-1` conv inputs —
  a fixed size, whatever the context length;
* per sequence: which cached positions are real tokens (left padding of batched prompts is not) and the next
  position id.

Rows are sequences; `select` keeps a subset (finished requests leave a batch), `clone` snapshots a cache
(prefix reuse), `memory_bytes` reports what it holds.
"""

from __future__ import annotations

import torch

from clover.config import FULL_ATTENTION, CloverConfig


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

    def clone(self) -> "AttentionLayerCache":
        new = AttentionLayerCache()
        kv = self.keys_values()
        if kv is not None:
            new.append(kv[0].clone(), kv[1].clone())
        return new

    def memory_bytes(self) -> int:
        kv = self.keys_values()
        return 0 if kv is None else sum(t.numel() * t.element_size() for t in kv)


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

    def memory_bytes(self) -> int:
        if self.state is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.state, self.conv))


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
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.valid.device)
        for layer in self.layers:
            layer.select(rows)
        self.valid, self.next_position = self.valid[rows], self.next_position[rows]
        self.batch_size = len(rows)

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
