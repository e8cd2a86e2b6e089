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

Optional fields are read as transformers' classes read them: no `head_dim` is `hidden_size / heads` (Qwen2.5's
files; Qwen3's config class defaults it to 128); `use_sliding_window` false (every published file) leaves every layer
full attention whatever `sliding_window` / `max_window_layers` say. Layers that do slide, and RoPE scaling other
than Llama 3's (YaRN and the like), are refused by name: Clover reads every layer with full attention. Block-diffusion
checkpoints built on these bases (SDAR, Fast-dLLM v2) carry the same layout but other conventions; this module
converts AR bases, which the training recipe then adapts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from clover.config import CloverConfig
from clover.conversion.common import HFSource, dense_mlp_layers, read_hf_dir, special_token_ids
from clover.conversion.llama import dense_config


def moe_config(hf, dense: CloverConfig) -> CloverConfig:
    """`dense` (Qwen3's attention and norms) with a Qwen3-MoE config's feed-forward (a dense model when no layer
    is sparse)."""
    dense_layers = dense_mlp_layers(hf)
    if len(dense_layers) == hf.num_hidden_layers:
        return dense
    return dataclasses.replace(
        dense, mlp_type="moe", num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size, shared_expert_intermediate_size=0,
        norm_topk_prob=bool(hf.norm_topk_prob), mlp_only_layers=dense_layers)


def check_full_attention(hf, model_type: str) -> None:
    """Refuse a sliding window where transformers' attention applies one: Qwen2 / Qwen3 on the layers `layer_types`
    marks "sliding_attention" (by default those from `max_window_layers` on, when `use_sliding_window`); Qwen3-MoE
    on every layer when `use_sliding_window` leaves `sliding_window` set. Published files set `use_sliding_window`
    false (their `sliding_window` / `max_window_layers` values are then unused)."""
    if model_type == "qwen3_moe":
        if hf.sliding_window is not None:
            raise ValueError(f"sliding-window attention (use_sliding_window true, sliding_window {hf.sliding_window}) "
                             "is not supported: Clover reads every layer with full attention")
        return
    sliding = [i for i, kind in enumerate(hf.layer_types) if kind != "full_attention"]
    if sliding:
        raise ValueError(f"sliding-window attention on layers {sliding} (sliding_window {hf.sliding_window}; "
                         "layer_types / use_sliding_window with max_window_layers) is not supported: Clover reads "
                         "every layer with full attention")


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
        check_full_attention(hf, model_type)
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
