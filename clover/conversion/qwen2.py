"""`--from qwen2`: Qwen2 / Qwen2.5 checkpoints (clover.conversion.qwen)."""

from __future__ import annotations

from pathlib import Path

from clover.conversion.qwen import QwenSource


def open_source(src: Path) -> QwenSource:
    return QwenSource(src, "qwen2")
