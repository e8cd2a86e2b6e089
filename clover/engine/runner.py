"""The model runner: what runs the network for the engine, behind one small interface.

The engine (engine.py, exact.py) decides tokens: requests, unmasking rules, sampling, batching, streaming. A
runner computes logits for it. One call, `forward`, covers every pass the engine makes (its layout is
`clover.model.layout.BlockLayout`'s):

    forward(ids, block_size, cache=..., prefix_len=..., attention_mask=..., query_ids=..., logits_at=...)

* `ids` `[N, T]`: clean tokens, written to `cache`: a causal prefix of `prefix_len`, then blocks of `block_size`
  (all causal for a model whose `context_reading` is "causal"); `attention_mask` marks padding (0) to skip.
* `query_ids` `[N, block_size]`: one block read against the cache, the clean tokens and itself in both
  directions, never cached (the masked block being denoised).
* `logits_at` `[N, T + block_size]` bool: the positions whose logits are needed (clean then query), returned as
  `[selected, V]` in row-major order; or `logits_to_keep=0` for none (a prefill chunk).

The cache is the runner's own (`new_cache`); the engine only keeps it per batch and calls `select(rows)` (rows
leave), `type(cache).concat(caches)` (batches join), `mark()` / `rewind(keep)` (exact mode undoes rejected drafts:
each row keeps the first `keep[r]` clean tokens of the forward after `mark`), and reads `length` / `batch_size`.

Runners: `TorchRunner` (this file: the PyTorch model, every architecture, CPU or CUDA) and
`clover.engine.llamacpp.LlamaCppRunner` (a GGUF on llama.cpp's quantised kernels; dense Llama-family models).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from clover.config import CloverConfig


@runtime_checkable
class RunnerCache(Protocol):
    @property
    def batch_size(self) -> int: ...

    @property
    def length(self) -> int: ...

    def select(self, rows: torch.Tensor | list[int]) -> None: ...

    def mark(self) -> None: ...

    def rewind(self, keep: torch.Tensor) -> None: ...


@runtime_checkable
class ModelRunner(Protocol):
    name: str
    config: CloverConfig
    device: torch.device
    # the server may keep prompt prefixes (`clover.serving.prefix_cache`, torch caches only)
    supports_prefix_reuse: bool
    max_rows: int | None  # rows one runner holds at once (None: as memory allows)
    max_block_size: int | None  # the largest block an engine may decode with (None: any); a query block alone
    # (decision mode's answer block) may be longer

    def new_cache(self, batch_size: int) -> Any: ...

    def forward(self, ids: torch.Tensor | None, block_size: int, *, cache: Any, prefix_len: int = 0,
                attention_mask: torch.Tensor | None = None, query_ids: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, logits_to_keep: int | None = None) -> torch.Tensor: ...


class TorchRunner:
    """`CloverForBlockDiffusion` as a runner: the reference every other runner is tested against."""

    name = "torch"
    supports_prefix_reuse = True
    max_rows = None
    max_block_size = None

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.config: CloverConfig = model.config
        self.device = next(model.parameters()).device

    def new_cache(self, batch_size: int) -> Any:
        return self.model.new_cache(batch_size)

    def forward(self, ids: torch.Tensor | None, block_size: int, *, cache: Any, **kwargs: Any) -> torch.Tensor:
        return self.model(ids, block_size, cache=cache, **kwargs).logits


def as_runner(model: torch.nn.Module | ModelRunner) -> ModelRunner:
    """A runner for `model`: a Clover model gets the torch runner; a runner is returned as it is."""
    if isinstance(model, torch.nn.Module):
        return TorchRunner(model)
    if isinstance(model, ModelRunner):
        return model
    raise TypeError(f"expected a Clover model (torch.nn.Module) or a model runner, got {type(model).__name__}")
