"""Clover's model: config-driven hybrid (Gated DeltaNet + gated attention + MoE) or dense Llama backbone."""

from clover.model.cache import CloverCache
from clover.model.layout import BlockLayout
from clover.model.modeling import CloverForBlockDiffusion, CloverOutput
from clover.model.quant import QUANTIZATIONS, quantize

__all__ = ["QUANTIZATIONS", "BlockLayout", "CloverCache", "CloverForBlockDiffusion", "CloverOutput", "quantize"]
