"""Prefix-cache entries as chains of fixed-size KV blocks that entries share (caches with `kv_block`: the torch
runner's `CloverCache`).

An entry that ends at grid point `n * grid` is the chain `b_0 .. b_{n-1}`: block `b_k` holds every attention
layer's keys and values at positions `[k * grid, (k + 1) * grid)`, and is found by the chain hash of the entry's
scope and *all* its tokens up to the block's end (`clover.serving.scheduling.prefix_cache.chain_hashes`). A position's
KV depends on every token before it, so two entries share a block exactly when they share that whole prefix, in the
same scope: an agent's next turn stores only the blocks of its new messages, and a second conversation with the
same system prompt and tools (same API key) stores them once. Another key's prompts never share a block (the
hash starts from the scope), so a block says nothing across keys.

Blocks live as long as a chain holds them (a weak table finds them), and the store counts each block's storage
once, however many chains hold it: the budget counts unique blocks. Exactness: a block's bits are what a
grid-aligned prefill of its tokens writes, whichever request wrote them (the prefix cache's docstring), so a
chain assembled from blocks of different requests is the cache that a cold prefill of its tokens leaves.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Hashable

import torch


@dataclass(eq=False)
class KVBlock:
    data: torch.Tensor  # [attention layers, 1, Hkv, grid, Dk + Dv] (`CloverCache.kv_block`)
    tokens: tuple[int, ...]  # its own grid tokens
    parent: "KVBlock | None"  # the block before it: a chain is verified block by block, never by its hash alone
    scope: Hashable = None  # whose prompt it holds (a block is never shared across scopes, even on a collision)


class BlockTable:
    """The blocks some chain holds, by chain hash."""

    def __init__(self) -> None:
        self.blocks: weakref.WeakValueDictionary[Hashable, KVBlock] = weakref.WeakValueDictionary()

    def chain(self, cache: Any, tokens: list[int], hashes: list[int], grid: int, end: int,
              scope: Hashable = None) -> "BlockChain":
        """The first `end` positions (a grid multiple) of the one-row `cache` (the prompt `tokens` of `scope`,
        `hashes` their chain hashes) as a chain: blocks already held are shared, the others copied out of `cache`."""
        blocks: list[KVBlock] = []
        for k in range(end // grid):
            block = self._held(tokens, hashes, grid, k, scope, blocks[-1] if blocks else None)
            if block is None:  # new (or a hash collision: the chain that holds the other one keeps it)
                block = KVBlock(cache.kv_block(k * grid, (k + 1) * grid), tuple(tokens[k * grid : (k + 1) * grid]),
                                blocks[-1] if blocks else None, scope)
                self.blocks[hashes[k]] = block
            blocks.append(block)
        key_dim = next((layer.k.shape[-1] for layer in cache.layers if getattr(layer, "k", None) is not None), 0)
        return BlockChain(blocks, grid, key_dim, cache)

    def new_bytes(self, cache: Any, tokens: list[int], hashes: list[int], grid: int, end: int,
                  scope: Hashable = None) -> int:
        """Bytes that `chain` (same arguments) would copy: its blocks not held yet."""
        parent, new = None, 0
        for k in range(end // grid):
            parent = self._held(tokens, hashes, grid, k, scope, parent)
            if parent is None:
                new = end // grid - k  # a block's children are new when it is
                break
        per_token = sum(layer.k[:, :, :1].numel() * layer.k.element_size() + layer.v[:, :, :1].numel()
                        * layer.v.element_size() for layer in cache.layers if getattr(layer, "k", None) is not None)
        return new * grid * per_token

    def _held(self, tokens: list[int], hashes: list[int], grid: int, k: int, scope: Hashable,
              parent: KVBlock | None) -> KVBlock | None:
        """The held block `k` of this chain (whose block `k - 1` is `parent`), or None."""
        block = self.blocks.get(hashes[k])
        if block is None or block.parent is not parent or block.scope != scope:
            return None
        return block if block.tokens == tuple(tokens[k * grid : (k + 1) * grid]) else None


class BlockChain:
    """A stored prefix (`clover.engine.runner.StoredPrefix`) over shared blocks."""

    def __init__(self, blocks: list[KVBlock], grid: int, key_dim: int, like: Any) -> None:
        self.blocks, self.grid, self.key_dim = blocks, grid, key_dim
        self._like = like.of_blocks([], 0, key_dim)  # an empty cache of the same layers (the template)

    @property
    def length(self) -> int:
        return len(self.blocks) * self.grid

    def prefix(self, length: int, snapshot: Any = None, copy: bool = False) -> Any:
        """A new one-row cache holding the first `length` positions (a grid multiple), `snapshot` the DeltaNet
        states there. The KV is always a copy (the request's own, contiguous buffers)."""
        if length % self.grid or not 0 < length <= self.length:
            raise ValueError(f"a block chain of {self.length} positions is cut on its {self.grid}-token grid; "
                             f"got {length}")
        return self._like.of_blocks([b.data for b in self.blocks[: length // self.grid]], length, self.key_dim,
                                    snapshot)

    def trim(self, length: int) -> None:
        """Keep the first `length` positions (the blocks past them are no longer held by this chain)."""
        del self.blocks[length // self.grid :]

    def storages(self, snapshots: Any = ()) -> dict[int, int]:
        """Storage pointer -> bytes of its blocks and `snapshots`, each once."""
        tensors = [b.data for b in self.blocks]
        tensors += [t for snap in snapshots if snap is not None for pair in snap if pair is not None for t in pair]
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
