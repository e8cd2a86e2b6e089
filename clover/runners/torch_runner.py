"""The torch runner: `CloverForBlockDiffusion` itself, every architecture, CPU or CUDA — the reference every other
runner is tested against. It is the engine's `ModuleRunner` (clover.engine.runner) opened from a checkpoint; its
cache is the model's `CloverCache`, which implements the runner cache interface (prefix reuse included) directly."""

from __future__ import annotations

from pathlib import Path

import torch

from clover.engine.runner import ModuleRunner
from clover.model import CloverForBlockDiffusion, quantize
from clover.runners.registry import RunnerOptions


class TorchRunner(ModuleRunner):
    @classmethod
    def open(cls, path: str | Path, options: RunnerOptions) -> TorchRunner:
        """The checkpoint directory `path`, cast to `options.dtype`, on `options.device`, quantised as
        `options.quant` says."""
        dtype = getattr(torch, options.dtype) if options.dtype else None
        model = CloverForBlockDiffusion.from_pretrained(path, dtype=dtype, device=options.device or "cpu")
        return cls(quantize(model, options.quant), Path(path))
