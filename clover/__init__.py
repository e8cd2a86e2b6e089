"""Clover: block-diffusion language models adapted from autoregressive checkpoints."""

from clover.config import CloverConfig
from clover.model import CloverCache, CloverForBlockDiffusion

__all__ = ["CloverCache", "CloverConfig", "CloverForBlockDiffusion"]
__version__ = "0.1.0"
