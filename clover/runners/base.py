"""The runner interface: what the engine (and the server) may ask of whatever runs the network.

One call, `forward`, covers every pass the engine makes (its layout is `clover.model.layout.BlockLayout`'s):

    forward(ids, block_size, cache=..., prefix_len=..., attention_mask=..., query_ids=..., logits_at=..., prompt=...)

* `ids` `[N, T]`: clean tokens, written to `cache`: a causal prefix of `prefix_len`, then blocks of `block_size`
  (all causal for a model whose `context_reading` is "causal"); `attention_mask` marks padding (0) to skip.
* `query_ids` `[N, block_size]`: one block read against the cache, the clean tokens and itself in both
  directions, never cached (the masked block being denoised).
* `logits_at` `[N, T + block_size]` bool: the positions whose logits are needed (clean then query), returned as
  `[selected, V]` in row-major order; or `logits_to_keep=0` for none (a prefill chunk).
* `prompt`: the forward reads prompt tokens (a prefill chunk, or the last one with the first query block). A runner
  whose arithmetic depends on how many rows share a forward computes prompt rows one way whatever shares them, so a
  prompt's cache has the same bits alone, batched or resumed from a stored prefix (the torch runner: an int8 / int4
  layer that rounds its input twice, `clover.model.prompt_rows`); a runner without such a path ignores it.

The cache is the runner's own (`new_cache`). The engine keeps it per batch and calls `select(rows)` (rows leave),
`type(cache).concat(caches)` (batches join), `mark()` / `rewind(keep)` (exact mode undoes rejected drafts: each
row keeps the first `keep[r]` clean tokens of the forward after `mark`), and reads `length` / `batch_size`. When
a batch ends it calls `release_cache(cache)`: a cache that holds a runner's scarce resource (llama.cpp's slots)
gives it back then, on the owner's thread; tensors need nothing (reference counting frees them).

**Prefix reuse** (the server's `clover.serving.scheduling.prefix_cache`) asks three more things of a one-row cache:
`snapshot()` (what a cut at the current length cannot recover: a DeltaNet layer's recurrent state; None where
every layer can be cut anywhere), `prefix(length, snapshot, copy=True)` (its first `length` tokens kept apart
from it: a `StoredPrefix` that outlives the request and is never written) and, on what that returns,
`prefix(length, snapshot)` (a fresh one-row cache holding the first `length` tokens, to prefill the rest of a
prompt into) and `storages(snapshots)` (the memory it holds, for the store's byte budget).

Runners: `clover.runners.torch_runner.TorchRunner` and `clover.runners.llamacpp.LlamaCppRunner`; each has
`open(path, RunnerOptions)`, and `clover.runners.registry` names them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from clover.config import CloverConfig


@dataclass(frozen=True)
class RunnerOptions:
    """How a runner is opened (`Runner.open(path, options)`); each runner refuses what it cannot honour, by name."""

    device: str | None = None  # None: the CPU
    dtype: str | None = None  # a torch dtype name to cast the weights to; None: as stored
    quant: str = "none"  # weight-only quantisation at load (clover.choices.QUANTIZATIONS)
    threads: int | None = None  # CPU threads of the runner's own kernels (llama.cpp's)
    max_rows: int | None = 1  # sequences held at once (None: as many as the runner allows)
    ctx: int | None = None  # KV cells shared by all rows (llama.cpp); None: the runner's default


@runtime_checkable
class StoredPrefix(Protocol):
    """The first `length` tokens of one sequence, kept for later requests (see the module docstring)."""

    @property
    def length(self) -> int: ...

    def prefix(self, length: int, snapshot: Any = None, copy: bool = False) -> Any: ...

    def storages(self, snapshots: Any = ()) -> dict[int, int]: ...


@runtime_checkable
class RunnerCache(Protocol):
    @property
    def batch_size(self) -> int: ...

    @property
    def length(self) -> int: ...

    def select(self, rows: torch.Tensor | list[int]) -> None: ...

    def mark(self) -> None: ...

    def rewind(self, keep: torch.Tensor) -> None: ...

    def snapshot(self) -> Any: ...

    def prefix(self, length: int, snapshot: Any = None, copy: bool = False) -> Any: ...


def release_cache(cache: Any) -> None:
    """Give back what `cache` holds of its runner now (its `release()`, where it has one: see the module docstring)."""
    release = getattr(cache, "release", None)
    if release is not None:
        release()


@runtime_checkable
class ModelRunner(Protocol):
    name: str
    config: CloverConfig
    device: torch.device
    max_rows: int | None  # rows one runner holds at once (None: as memory allows)
    max_context: int  # positions one row may hold, prompt and answer together
    max_block_size: int | None  # the largest block an engine may decode with (None: any); a query block alone
    # (decision mode's answer block) may be longer

    @classmethod
    def open(cls, path: str | Path, options: RunnerOptions) -> ModelRunner: ...

    def tokenizer(self) -> Any: ...

    def new_cache(self, batch_size: int) -> Any: ...

    def forward(self, ids: torch.Tensor | None, block_size: int, *, cache: Any, prefix_len: int = 0,
                attention_mask: torch.Tensor | None = None, query_ids: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, logits_to_keep: int | None = None,
                prompt: bool = False) -> torch.Tensor: ...
