"""Qwen3.5 / Qwen3.6 HF checkpoints, MoE (35B-A3B) and dense (0.8B ... 27B) -> Clover.

Clover's state-dict names *are* transformers' `Qwen3_5MoeForCausalLM` / `Qwen3_5ForCausalLM` names, so this is a
prefix map:

* text checkpoint (`Qwen3_5MoeTextConfig` / `Qwen3_5TextConfig`, model_type `qwen3_5_moe_text` / `qwen3_5_text`):
  `model.X` -> `model.X`;
* multimodal release (`Qwen3_5MoeConfig` / `Qwen3_5Config` with a nested `text_config`, model_type `qwen3_5_moe`
  / `qwen3_5`): `model.language_model.X` -> `model.X`; `model.visual.*` (vision tower) and `mtp.*`
  (multi-token-prediction head) are not part of the text model and are skipped;
* routed experts stored fused (`mlp.experts.gate_up_proj` `[E, 2I, H]`, `mlp.experts.down_proj` `[E, H, I]`)
  are copied; stored per expert (`mlp.experts.N.{gate,up,down}_proj.weight`) they are stacked.

The architecture facts Clover relies on are fixed for this family: zero-centred RMSNorm, gated attention
with q/k norms, partial RoPE; the MoE models' softmax top-k router with renormalised weights and sigmoid-gated
shared expert; the dense models' SwiGLU of width `intermediate_size`. Fields of the published files that
transformers' Qwen3.5 classes do not read are not read here either (`attn_output_gate`: always gated;
`mlp_only_layers`, `norm_topk_prob`: every layer sparse, always renormalised; `mtp_*`, `mamba_ssm_dtype`, `dtype`);
`layer_types`, when absent, follow `full_attention_interval` (default 4), and `partial_rotary_factor` defaults to
0.25, as the config classes derive them. The multimodal release ties its embeddings by its top-level
`tie_word_embeddings`, which its class (`...ForConditionalGeneration`) reads, falling back on text_config's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clover.config import CloverConfig
from clover.conversion.common import HFSource, read_hf_dir, require_silu, rope_settings, special_token_ids

# `--from NAME` -> (multimodal release, text checkpoint) model types
MODEL_TYPES = {"qwen3_5_moe": ("qwen3_5_moe", "qwen3_5_moe_text"), "qwen3_5": ("qwen3_5", "qwen3_5_text")}


def hybrid_config(text: Any, token_ids: dict[str, Any], tie_word_embeddings: bool, **overrides: Any) -> CloverConfig:
    """CloverConfig for a Qwen hybrid (Qwen3.5 / Qwen3.5-MoE / Qwen3-Next) text config object from transformers:
    a sparse MoE feed-forward where the config has experts, else a dense SwiGLU."""
    require_silu(text)
    if getattr(text, "attention_bias", False):
        raise ValueError("attention_bias=True is not supported: the source has q/k/v/o biases and Clover's "
                         "attention has no o_proj bias")
    fields: dict[str, Any] = dict(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        num_hidden_layers=text.num_hidden_layers,
        layer_types=list(text.layer_types),
        max_position_embeddings=text.max_position_embeddings,
        rms_norm_eps=text.rms_norm_eps,
        norm_type="zero_centered",
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=text.initializer_range,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        head_dim=text.head_dim or text.hidden_size // text.num_attention_heads,
        **rope_settings(text),
        attention_bias=False,
        attn_output_gate=True,
        qk_norm=True,
        linear_conv_kernel_dim=text.linear_conv_kernel_dim,
        linear_key_head_dim=text.linear_key_head_dim,
        linear_value_head_dim=text.linear_value_head_dim,
        linear_num_key_heads=text.linear_num_key_heads,
        linear_num_value_heads=text.linear_num_value_heads,
        mask_token_id=None,  # placed by the driver (plan_mask_token)
        **token_ids,
    )
    if getattr(text, "num_experts", 0):
        fields.update(mlp_type="moe", num_experts=text.num_experts, num_experts_per_tok=text.num_experts_per_tok,
                      moe_intermediate_size=text.moe_intermediate_size,
                      shared_expert_intermediate_size=text.shared_expert_intermediate_size, norm_topk_prob=True)
    else:
        fields.update(mlp_type="dense", intermediate_size=text.intermediate_size)
    fields.update(overrides)
    return CloverConfig(**fields)


class Qwen35Source(HFSource):
    """`name` is the `--from` name ("qwen3_5" or "qwen3_5_moe"); `released` the config.json `model_type` a checkpoint
    in that layout carries (a block-diffusion family's: clover.conversion.released), by default the base's own."""

    def __init__(self, src: Path, name: str, released: str | None = None) -> None:
        # deferred: transformers, only when a checkpoint of this family is read
        from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

        raw, generation = read_hf_dir(src)
        model_type = raw.get("model_type")
        expected = (released,) if released else MODEL_TYPES[name]
        if model_type not in expected:
            raise ValueError(f"{src}/config.json has model_type {model_type!r}; --from {name} expects one of "
                             f"{list(expected)}")
        multimodal, text_config = {"qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3_5MoeTextConfig),
                                   "qwen3_5": (Qwen3_5Config, Qwen3_5TextConfig)}[name]
        fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "architectures")}
        if "text_config" in raw:  # multimodal release: the text tower is nested
            text = multimodal.from_dict(fields).text_config
            prefix = "model.language_model."
            raw_text = raw["text_config"] or {}
            # the release's own class (its `architectures`, ...ForConditionalGeneration) ties by the top-level field;
            # a file without one falls back on text_config's, as loading the text tower alone reads it
            tied = bool(raw.get("tie_word_embeddings", raw_text.get("tie_word_embeddings", False)))
        else:
            text = text_config.from_dict(fields)
            prefix, raw_text, tied = "model.", raw, bool(text.tie_word_embeddings)
        token_ids = special_token_ids(generation, raw_text, raw)
        self.config = hybrid_config(text, token_ids, tied)
        super().__init__(src, prefix, ignore=lambda name: name.startswith(("model.visual.", "mtp.")),
                         tie_word_embeddings=tied)


def open_source(src: Path, source_format: str) -> Qwen35Source:
    """`--from qwen3_5` (dense Qwen3.5 hybrids) or `--from qwen3_5_moe` (Qwen3.5-MoE / Qwen3.6-MoE)."""
    return Qwen35Source(src, source_format)
