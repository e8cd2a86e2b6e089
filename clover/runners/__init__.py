"""Runners: what runs the network for the engine, behind the engine's interface (`clover.engine.runner`: ModelRunner,
RunnerCache, StoredPrefix), each opened by `open(path, RunnerOptions)` and chosen by name (`registry`).

    torch_runner  TorchRunner: the PyTorch model opened from a checkpoint, every architecture, CPU or CUDA (the
                  reference)
    llamacpp      LlamaCppRunner: a GGUF on llama.cpp's quantised CPU kernels (Clover's dense exports)
    llamacpp_hybrid, llamacpp_plain  its causal-path subclasses: hybrid exports, plain AR GGUFs
    llamacpp_open LlamaCppFile: `--runner llamacpp`, the class a GGUF file needs
    llama_api, llamacpp_ar  llama.cpp's C API (ctypes); its own greedy loop (the benchmarks' baseline)
    registry      name -> runner class, imported on first use (`--runner`, `clover info --runners`); RunnerOptions

This package's `__init__` imports only the registry, so listing the runners costs no torch import.
"""

from clover.runners.registry import RUNNERS, RunnerEntry, RunnerOptions, register_runner, runner_class, runner_entry

__all__ = ["RUNNERS", "RunnerEntry", "RunnerOptions", "register_runner", "runner_class", "runner_entry"]
