"""Where Clover keeps what it builds once and reuses: converted models, compiled kernels, measured costs.

The bottom of the package: every layer may import it, it imports nothing of Clover's.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$CLOVER_CACHE`, default `~/.cache/clover` (an empty value is unset: not the current directory)."""
    return Path(os.environ.get("CLOVER_CACHE") or Path.home() / ".cache" / "clover").expanduser()
