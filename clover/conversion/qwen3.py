"""`--from qwen3`: Qwen3 dense checkpoints (clover.conversion.qwen)."""

from __future__ import annotations

from pathlib import Path

from clover.conversion.qwen import QwenSource


def open_source(src: Path) -> QwenSource:
    return QwenSource(src, "qwen3")
