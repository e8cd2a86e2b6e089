"""The runners by name: what `--runner` offers and `clover info --runners` lists.

A runner is registered by name with the class that opens it, as an import path ("module:Class"), so listing the
names imports nothing: the CLI builds its parsers without torch or llama.cpp (tests/cli/test_startup.py); the class
is imported when a command opens the runner.

    register_runner("mine", "my_package.runner:MyRunner", takes="checkpoint", summary="...")
    runner_class("mine").open(path, RunnerOptions(...))   # a runner of the engine's interface (clover.engine.runner)

`takes` says what `--model` names for it: "checkpoint" (a Clover checkpoint directory) or "gguf" (a GGUF file);
the CLI resolves the default model in that form (clover.cli.loading).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

SOURCES = ("checkpoint", "gguf")


@dataclass(frozen=True)
class RunnerOptions:
    """How a runner is opened (`Runner.open(path, options)`); each runner refuses what it cannot honour, by name."""

    device: str | None = None  # None: the CPU
    dtype: str | None = None  # a torch dtype name to cast the weights to; None: as stored
    quant: str = "none"  # weight-only quantisation at load (clover.choices.QUANTIZATIONS)
    threads: int | None = None  # CPU threads of the runner's own kernels (llama.cpp's)
    max_rows: int | None = 1  # sequences held at once (None: as many as the runner allows)
    ctx: int | None = None  # KV cells shared by all rows (llama.cpp); None: the runner's default


@dataclass(frozen=True)
class RunnerEntry:
    name: str
    target: str  # "module:Class", imported on first use
    takes: str  # one of SOURCES
    devices: tuple[str, ...]  # where it runs ("cpu", "cuda"); the first is its default
    summary: str  # one line for --help and `clover info --runners`

    def load(self) -> Any:
        """The runner class (importing its module now)."""
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


RUNNERS: dict[str, RunnerEntry] = {}


def register_runner(name: str, target: str, *, takes: str, summary: str, devices: tuple[str, ...] = ("cpu",)) -> None:
    if takes not in SOURCES:
        raise ValueError(f"a runner takes one of {SOURCES}, got {takes!r}")
    if ":" not in target:
        raise ValueError(f"a runner's target is 'module:Class', got {target!r}")
    if name in RUNNERS and RUNNERS[name].target != target:
        raise ValueError(f"a runner named {name!r} is already registered ({RUNNERS[name].target})")
    RUNNERS[name] = RunnerEntry(name, target, takes, tuple(devices), summary)


def runner_entry(name: str) -> RunnerEntry:
    if name not in RUNNERS:
        raise ValueError(f"no runner named {name!r}; registered: {', '.join(sorted(RUNNERS))}")
    return RUNNERS[name]


def runner_class(name: str) -> Any:
    return runner_entry(name).load()


register_runner("torch", "clover.runners.torch_runner:TorchRunner", takes="checkpoint", devices=("cpu", "cuda"),
                summary="the PyTorch model: any Clover checkpoint, CPU or CUDA, every decoding mode (the reference)")
register_runner("llamacpp", "clover.runners.llamacpp_open:LlamaCppFile", takes="gguf",
                summary="llama.cpp's quantised CPU kernels: a GGUF from `clover export --to gguf` (dense Llama-family "
                        "models; hybrids' causal path), or any plain AR GGUF at block size 1 / exact mode "
                        "(docs/gguf.md)")
