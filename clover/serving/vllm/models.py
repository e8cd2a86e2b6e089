"""The architectures the plugin registers: vLLM's own Llama and Qwen3-Next models, loading a Clover checkpoint's
causal path (`clover.serving.vllm.weights`). Nothing of the network is reimplemented: layers, kernels, the paged
KV cache, the Gated DeltaNet state, tensor / pipeline / expert parallelism are vLLM's. Imported by vLLM only."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

from clover.config import CloverConfig
from clover.serving.vllm.config import check_checkpoint
from clover.serving.vllm.weights import causal_path_tensors


class CloverCausalPath:
    """Mixin before a vLLM model class: checks the checkpoint, then loads its causal path's tensors."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        model = Path(vllm_config.model_config.model)
        if model.is_dir():  # a local checkpoint: what only its files tell (a quantised build, an ungated adapter)
            check_checkpoint(model)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.clover_config = CloverConfig.from_dict(vllm_config.model_config.hf_config.clover_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(causal_path_tensors(weights, self.clover_config))


class CloverLlamaForCausalLM(CloverCausalPath, LlamaForCausalLM):
    pass


class CloverQwen3NextForCausalLM(CloverCausalPath, Qwen3NextForCausalLM):
    pass
