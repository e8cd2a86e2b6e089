"""The runner interface: what the engine (and the server) may ask of whatever runs the network, and the adaptor
that makes any module with Clover's forward signature one (`ModuleRunner`). The engine owns this interface and never
imports a model (as transformers' generation sits below its models): `clover.model`'s `generate` hands its module
over, and the runners of `clover.runners` implement it.

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
  layer that rounds its input twice, `clover.model.prompt_rows`; `ModuleRunner` passes it to the module's forward
  as its `prompt` keyword); a runner without such a path ignores it.

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

Runners: `ModuleRunner` (a module in memory: `as_runner`), `clover.runners.torch_runner.TorchRunner` (the same,
opened from a checkpoint) and `clover.runners.llamacpp.LlamaCppRunner`. The engine never opens one: the runners of
`clover.runners` each have `open(path, RunnerOptions)`, and `clover.runners.registry` names them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from clover.config import CloverConfig


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

    def tokenizer(self) -> Any: ...

    def new_cache(self, batch_size: int) -> Any: ...

    def forward(self, ids: torch.Tensor | None, block_size: int, *, cache: Any, prefix_len: int = 0,
                attention_mask: torch.Tensor | None = None, query_ids: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, logits_to_keep: int | None = None,
                prompt: bool = False) -> torch.Tensor: ...


class ModuleRunner:
    """A module with Clover's forward signature (`forward(ids, block_size, *, cache, prompt, ...)` returning an
    output with `.logits`, `new_cache(n)`, `config`), in memory: the torch model run as it is."""

    name = "torch"  # the torch runner's (`clover.runners.registry`): cost tables are kept per runner name
    max_rows = None
    max_block_size = None

    def __init__(self, model: torch.nn.Module, directory: Path | None = None) -> None:
        self.model = model
        self.config: CloverConfig = model.config
        self.max_context = self.config.max_position_embeddings
        self.device = next(model.parameters()).device
        self.directory = directory  # the checkpoint it was opened from (its tokenizer), when known

    @property
    def quantization(self) -> dict[str, Any] | None:
        return getattr(self.model, "quantization", None)

    def tokenizer(self) -> Any:
        from clover.tokenizer import load_tokenizer  # deferred: tokenizers, only when one is read

        if self.directory is None:
            raise ValueError("this torch runner wraps a model in memory: it has no checkpoint to read a tokenizer from")
        return load_tokenizer(self.directory)

    def new_cache(self, batch_size: int) -> Any:
        return self.model.new_cache(batch_size)

    def forward(self, ids: torch.Tensor | None, block_size: int, *, cache: Any, prompt: bool = False,
                **kwargs: Any) -> torch.Tensor:
        return self.model(ids, block_size, cache=cache, prompt=prompt, **kwargs).logits


def as_runner(model: torch.nn.Module | ModelRunner) -> ModelRunner:
    """A runner for `model`: a module gets `ModuleRunner`; a runner is returned as it is."""
    if isinstance(model, torch.nn.Module):
        return ModuleRunner(model)
    if isinstance(model, ModelRunner):
        return model
    raise TypeError(f"expected a Clover model (torch.nn.Module) or a model runner, got {type(model).__name__}")
