"""`--runner llamacpp`: the llama.cpp runner class a GGUF file needs, chosen from its header.

    Clover's export of a dense model        LlamaCppRunner        (clover.runners.llamacpp)
    Clover's export of a hybrid             HybridLlamaCppRunner  (clover.runners.llamacpp_hybrid: qwen35moe / qwen35)
    a file llama.cpp's own converter wrote  PlainLlamaCppRunner   (clover.runners.llamacpp_plain: no Clover metadata)

    runner = LlamaCppFile.open("model.q4_0.gguf", options)   # what `runner_class("llamacpp")` gives

The choice lives here, above the three classes, so the parent class never imports its subclasses.
"""

from __future__ import annotations

from pathlib import Path

from clover.conversion.gguf import gguf_architecture, written_by_clover
from clover.conversion.gguf_header import read_header
from clover.runners.registry import RunnerOptions
from clover.runners.llamacpp import LlamaCppRunner
from clover.runners.llamacpp_hybrid import HYBRID_ARCHITECTURES, HybridLlamaCppRunner
from clover.runners.llamacpp_plain import PlainLlamaCppRunner


def runner_class_for(path: Path) -> type[LlamaCppRunner]:
    """The class that runs GGUF file `path` (its header read, not its tensors)."""
    header = read_header(path)
    if not written_by_clover(header):
        return PlainLlamaCppRunner
    if gguf_architecture(path, header) in HYBRID_ARCHITECTURES:
        return HybridLlamaCppRunner
    return LlamaCppRunner


class LlamaCppFile:
    """The registry's `llamacpp` runner: `open` a GGUF file with the class it needs (`runner_class_for`)."""

    name = LlamaCppRunner.name

    @staticmethod
    def open(path: str | Path, options: RunnerOptions) -> LlamaCppRunner:
        path = Path(path)
        cls = runner_class_for(path) if path.is_file() else LlamaCppRunner  # a missing file: the runner names it
        return cls.open(path, options)
