"""Clover checkpoints on vLLM: the plugin vLLM loads through the `vllm.general_plugins` entry point
(pyproject.toml), and `clover serve --engine vllm` (`launch`).

vLLM serves a Clover checkpoint's causal path, its AR base exactly, on vLLM's own models (`config` says which and
what is refused, `weights` maps the tensors, `models` holds the registered classes): greedy decoding gives the
tokens of Clover's block size 1 and exact mode; block decoding, threshold rules and decision mode stay in
`clover serve`. docs/scale.md says which engine for which setup.
"""

from __future__ import annotations


def register() -> None:
    """vLLM's plugin hook, run in each of its processes: transformers learns `model_type: clover` and vLLM's
    registry the architectures (by name: vLLM imports the classes when a model needs them)."""
    # deferred: vLLM, which only its own processes have, and transformers (the config module's)
    from vllm import ModelRegistry

    from clover.serving.vllm.config import ARCHITECTURES, register_transformers_config

    register_transformers_config()
    for name in ARCHITECTURES:
        if name not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(name, f"clover.serving.vllm.models:{name}")
