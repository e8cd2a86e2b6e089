"""Clover: block-diffusion language models adapted from autoregressive checkpoints."""

from clover.config import CloverConfig
from clover.model import CloverCache, CloverForBlockDiffusion, quantize

__all__ = ["CloverCache", "CloverConfig", "CloverForBlockDiffusion", "decide", "decide_batch", "quantize"]
__version__ = "0.1.0"


def __getattr__(name: str):  # noqa: ANN202 - lazy: decision decoding pulls in the engine and the chat template
    if name in ("decide", "decide_batch"):
        from clover.engine import decision

        return getattr(decision, name)
    raise AttributeError(f"module 'clover' has no attribute {name!r}")
