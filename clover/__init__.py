"""Clover: block-diffusion language models adapted from autoregressive checkpoints."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from clover.config import CloverConfig

if TYPE_CHECKING:
    from clover.engine.loops.decision import decide, decide_batch
    from clover.model import CloverCache, CloverForBlockDiffusion, quantize

__all__ = ["CloverCache", "CloverConfig", "CloverForBlockDiffusion", "decide", "decide_batch", "quantize"]
__version__ = "0.1.0"

# Imported on first use: the model pulls in torch (seconds), which `import clover` (and so `clover --help`)
# should not pay for; decision decoding also pulls in the engine and the chat template.
_LAZY = {"CloverCache": "clover.model", "CloverForBlockDiffusion": "clover.model", "quantize": "clover.model",
         "decide": "clover.engine.loops.decision", "decide_batch": "clover.engine.loops.decision"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'clover' has no attribute {name!r}")
