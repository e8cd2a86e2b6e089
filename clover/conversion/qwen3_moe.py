"""`--from qwen3_moe`: Qwen3-MoE checkpoints (clover.conversion.qwen)."""

from __future__ import annotations

from pathlib import Path

from clover.conversion.qwen import QwenSource


def open_source(src: Path) -> QwenSource:
    return QwenSource(src, "qwen3_moe")
