"""The torch runner: `CloverForBlockDiffusion` itself, every architecture, CPU or CUDA — the reference every other
runner is tested against. Its cache is the model's `CloverCache`, which implements the runner cache interface
(prefix reuse included) directly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from clover.config import CloverConfig
from clover.model import CloverForBlockDiffusion, quantize
from clover.model.prompt_rows import reading_prompt
from clover.runners.base import ModelRunner, RunnerOptions


class TorchRunner:
    name = "torch"
    max_rows = None
    max_block_size = None

    def __init__(self, model: torch.nn.Module, directory: Path | None = None) -> None:
        self.model = model
        self.config: CloverConfig = model.config
        self.max_context = self.config.max_position_embeddings
        self.device = next(model.parameters()).device
        self.directory = directory  # the checkpoint it was opened from (its tokenizer), when known

    @classmethod
    def open(cls, path: str | Path, options: RunnerOptions) -> TorchRunner:
        """The checkpoint directory `path`, cast to `options.dtype`, on `options.device`, quantised as
        `options.quant` says."""
        dtype = getattr(torch, options.dtype) if options.dtype else None
        model = CloverForBlockDiffusion.from_pretrained(path, dtype=dtype, device=options.device or "cpu")
        return cls(quantize(model, options.quant), Path(path))

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
        with reading_prompt(prompt):  # the model's layers read it (clover.model.prompt_rows)
            return self.model(ids, block_size, cache=cache, **kwargs).logits


def as_runner(model: torch.nn.Module | ModelRunner) -> ModelRunner:
    """A runner for `model`: a Clover model gets the torch runner; a runner is returned as it is."""
    if isinstance(model, torch.nn.Module):
        return TorchRunner(model)
    if isinstance(model, ModelRunner):
        return model
    raise TypeError(f"expected a Clover model (torch.nn.Module) or a model runner, got {type(model).__name__}")
