"""Conversion of AR checkpoints into Clover checkpoints: `convert(source_format, src, dst)`.

One module per source layout (`clover.choices.SOURCE_FORMATS` names it for each `--from` format), each exposing
`open_source(src, source_format) -> Source` (see `common.Source`); the shared driver `common.run_conversion` does
the rest (mask token, Clover-only parameters, dtype, checks, atomic
write). `clover convert --from FORMAT SRC DST` is a thin wrapper over `convert`.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from clover.choices import SOURCE_FORMATS
from clover.conversion.common import resolve_dtype, run_conversion


def convert(source_format: str, src: str | Path, dst: str | Path, force: bool = False,
            dtype: torch.dtype | str | None = None, progress: bool = False) -> Path:
    """Convert the `source_format` checkpoint at `src` into a Clover checkpoint directory `dst`.

    `dtype` (e.g. torch.bfloat16 or "bfloat16") casts floating tensors; None keeps the source's (GGUF:
    fp32, dequantised). An existing `dst` is refused unless `force`, in which case it is replaced
    atomically. Returns `dst`.
    """
    if source_format not in SOURCE_FORMATS:
        raise ValueError(f"unknown source format {source_format!r}; valid formats: {', '.join(SOURCE_FORMATS)}")
    src, dst = Path(src), Path(dst)
    if not src.exists():
        raise FileNotFoundError(f"source {src} not found")
    if dst.resolve() == src.resolve():
        raise ValueError(f"destination {dst} is the source itself")
    if dst.exists() and not force:
        raise FileExistsError(f"destination {dst} already exists; pass force=True (--force) to replace it")
    resolved = resolve_dtype(dtype)
    module = importlib.import_module(f"clover.conversion.{SOURCE_FORMATS[source_format]}")
    with module.open_source(src, source_format) as source:
        return run_conversion(source, dst, force=force, dtype=resolved, progress=progress)


__all__ = ["SOURCE_FORMATS", "convert"]
