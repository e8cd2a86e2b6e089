"""`--from qwen3_5_moe`: Qwen3.5-MoE / Qwen3.6-MoE checkpoints (clover.conversion.qwen3_5)."""

from __future__ import annotations

from pathlib import Path

from clover.conversion.qwen3_5 import Qwen35Source


def open_source(src: Path) -> Qwen35Source:
    return Qwen35Source(src, "qwen3_5_moe")
