"""`--from sdar`: released checkpoints of this family (clover.conversion.released, conventions in .families)."""

from __future__ import annotations

from pathlib import Path

from clover.conversion.common import HFSource
from clover.conversion.released import open_source as _open


def open_source(src: Path) -> HFSource:
    return _open(src, "sdar")
