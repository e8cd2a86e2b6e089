"""Qwen3 (dense), Qwen3-MoE and Qwen2 / Qwen2.5 HF checkpoints -> Clover.

All are Llama-form, with Llama's tensor names, and differ from it in one place each:

* **Qwen3** (`Qwen3ForCausalLM`) RMS-normalises each head's queries and keys over `head_dim` before RoPE
  (`self_attn.q_norm` / `k_norm`, plain `norm(x) * w`): Clover's `qk_norm` with `norm_type: plain`. Its
  `attention_bias` would also put a bias on `o_proj`, which Clover has not: refused.
* **Qwen2** (`Qwen2ForCausalLM`, the Qwen2.5 family) adds biases to q, k and v (never to o): Clover's
  `attention_bias`.
* **Qwen3-MoE** (`Qwen3MoeForCausalLM`) is Qwen3's attention with a sparse MoE feed-forward: softmax top-k router
  (`mlp.gate`, renormalised when `norm_topk_prob`), routed SwiGLU experts (stored per expert, fused on reading),
  no shared expert (Clover's `shared_expert_intermediate_size` 0). Layers that `decoder_sparse_step` or
  `mlp_only_layers` leave dense become Clover's `mlp_only_layers`.

Sliding-window layers (`use_sliding_window`, `layer_types` with `sliding_attention`) and RoPE scaling (YaRN
and the like) are refused: Clover reads every layer with full attention and plain RoPE. Block-diffusion
checkpoints built on these bases (SDAR, Fast-dLLM v2) carry the same layout but other conventions; this module
converts AR bases, which the training recipe then adapts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from clover.config import CloverConfig
from clover.conversion.common import HFSource, read_hf_dir, special_token_ids
from clover.conversion.llama import dense_config


def moe_config(hf, dense: CloverConfig) -> CloverConfig:
    """`dense` (Qwen3's attention and norms) with a Qwen3-MoE config's feed-forward."""
    step = hf.decoder_sparse_step
    dense_layers = [i for i in range(hf.num_hidden_layers)
                    if i in hf.mlp_only_layers or hf.num_experts == 0 or (i + 1) % step]
    return dataclasses.replace(
        dense, mlp_type="moe", num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size, shared_expert_intermediate_size=0,
        norm_topk_prob=bool(hf.norm_topk_prob), mlp_only_layers=dense_layers)


class QwenSource(HFSource):
    """`model_type` is the base layout ("qwen3" / "qwen2" / "qwen3_moe"); `released` the config.json `model_type` a checkpoint
    in that layout carries (a block-diffusion family's: clover.conversion.released), by default the base's own."""

    def __init__(self, src: Path, model_type: str, released: str | None = None) -> None:
        # deferred: transformers, only when a checkpoint of this family is read
        from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig

        raw, generation = read_hf_dir(src)
        expected = released or model_type
        if raw.get("model_type") != expected:
            raise ValueError(f"{src}/config.json has model_type {raw.get('model_type')!r}; --from {expected} "
                             f"expects {expected!r}")
        fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "architectures")}
        hf = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig}[model_type].from_dict(fields)
        sliding = [i for i, kind in enumerate(getattr(hf, "layer_types", None) or []) if kind != "full_attention"]
        if getattr(hf, "use_sliding_window", False) or sliding:
            raise ValueError(f"sliding-window attention (layers {sliding or 'per use_sliding_window'}) is not "
                             "supported: Clover reads every layer with full attention")
        if model_type != "qwen2" and hf.attention_bias:
            raise ValueError(f"attention_bias is not supported for {model_type}: it also biases o_proj, which "
                             "Clover's attention has not")
        config = dense_config(hf, special_token_ids(generation, raw), qkv_bias=model_type == "qwen2",
                              qk_norm=model_type != "qwen2")
        self.config = moe_config(hf, config) if model_type == "qwen3_moe" else config
        super().__init__(src, "model.", tie_word_embeddings=bool(hf.tie_word_embeddings))


def open_source(src: Path, source_format: str) -> QwenSource:
    """`--from qwen3 | qwen3_moe | qwen2`."""
    return QwenSource(src, source_format)
