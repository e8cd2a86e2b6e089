"""The training data stream: which documents an optimizer step takes, and the seeds of their noise.

Step `s` takes stream positions `[s * batch_size, (s + 1) * batch_size)` of an endless stream that visits the
documents in a seeded permutation per epoch; a document's noise is seeded from (seed, stream position) by
`mix_seed`, so neither depends on the batch a document lands in or on the number of processes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clover.training.config import TrainConfig
from clover.training.distributed import DistInfo


def mix_seed(*values: int) -> int:
    """A 63-bit seed from integers, hashed by numpy's `SeedSequence`: independent streams for (seed, position).

    Each value (taken mod 2^64) enters as two 32-bit words, so different tuples never share an entropy pool."""
    words = [w for v in values for w in (int(v) & 0xFFFFFFFF, (int(v) >> 32) & 0xFFFFFFFF)]
    return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0] >> np.uint64(1))


class DocumentStream:
    """An endless, deterministic stream over a random-access document collection (reshuffled every epoch)."""

    def __init__(self, documents: Sequence[Any], seed: int, shuffle: bool = True) -> None:
        if len(documents) == 0:
            raise ValueError("the training data has no documents")
        self.documents, self.seed, self.shuffle = documents, seed, shuffle
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            n = len(self.documents)
            if self.shuffle:
                gen = torch.Generator().manual_seed(mix_seed(self.seed, 0xDA7A, epoch))
                self._orders = {epoch: torch.randperm(n, generator=gen)}
            else:
                self._orders = {epoch: torch.arange(n)}
        return self._orders[epoch]

    def take(self, start: int, count: int) -> list[tuple[int, Any]]:
        """`(stream position, document)` for positions `[start, start + count)`."""
        n = len(self.documents)
        return [(k, self.documents[int(self._order(k // n)[k % n])]) for k in range(start, start + count)]


def load_documents(config: TrainConfig, which: str, dist_info: DistInfo) -> Sequence[Any] | None:
    """The `train_data` / `eval_data` documents: token shards, or sources tokenized once into output_dir/data."""
    # deferred: clover.training.data loads transformers, needed only when a run reads its documents
    from clover.training.data import TokenShards, expand_sources, prepare_token_shards

    source = config.train_data if which == "train" else config.eval_data
    if not source:
        if which == "train":
            raise ValueError("train_data is empty: give a token-shard directory (clover data ...) or sources")
        return None
    if config.data_kind == "shards":
        return TokenShards(source)
    out = Path(config.output_dir) / "data" / which
    tokenizer = config.tokenizer or config.init
    if dist_info.rank == 0:
        files = [str(f) for f in expand_sources([source])]
        meta_path = out / "meta.json"
        fresh = meta_path.is_file() and json.loads(meta_path.read_text()).get("sources") == files
        if not fresh:
            prepare_token_shards(config.data_kind, [source], tokenizer, out, max_len=config.max_seq_len,
                                 overwrite=True)
    dist_info.barrier()
    return TokenShards(out)
