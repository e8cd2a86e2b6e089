"""Llama HF checkpoints (`LlamaForCausalLM`: Llama 3.x, the SmolLM2 family) -> Clover's dense backbone.

Names are identical (`model.layers.N.self_attn.q_proj.weight`, `mlp.gate_proj.weight`, ...), so tensors are
copied. The config maps to: plain RMSNorm (`y = norm(x) * w`), attention without output gate or q/k norm,
full RoPE (`partial_rotary_factor` 1), dense SwiGLU of width `intermediate_size`, every layer full attention,
embeddings tied as in the source, `head_dim` (absent in most files) `hidden_size / heads`, Llama 3's RoPE scaling
(`rope_scaling` rope_type "llama3", in every Llama 3.x config.json) kept as `CloverConfig.rope_scaling`.
Llama's `attention_bias` also puts a bias on `o_proj`, and `mlp_bias` on the MLP, neither of which Clover has, so
both are refused, as is any other RoPE scaling (linear, dynamic, yarn, ...).
"""

from __future__ import annotations

from pathlib import Path

from clover.config import FULL_ATTENTION, CloverConfig
from clover.conversion.common import HFSource, read_hf_dir, require_silu, rope_settings, special_token_ids


def llama_config(hf, token_ids: dict, max_position_embeddings: int | None = None) -> CloverConfig:
    """CloverConfig for a transformers `LlamaConfig` (also used for GGUF metadata mapped onto one)."""
    if hf.attention_bias or getattr(hf, "mlp_bias", False):
        raise ValueError("attention_bias / mlp_bias are not supported: Clover's dense backbone has no o_proj "
                         "or MLP biases")
    return dense_config(hf, token_ids, max_position_embeddings)


def dense_config(hf, token_ids: dict, max_position_embeddings: int | None = None, *, qkv_bias: bool = False,
                 qk_norm: bool = False) -> CloverConfig:
    """CloverConfig for a Llama-form transformers config (every layer full attention, dense SwiGLU, plain
    RMSNorm, RoPE plain or Llama-3-scaled); `qkv_bias`: biases on q, k and v (Qwen2); `qk_norm`: each head's
    queries and keys RMS-normalised before RoPE (Qwen3)."""
    require_silu(hf)
    return CloverConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        num_hidden_layers=hf.num_hidden_layers,
        layer_types=[FULL_ATTENTION] * hf.num_hidden_layers,
        max_position_embeddings=max_position_embeddings or hf.max_position_embeddings,
        rms_norm_eps=hf.rms_norm_eps,
        norm_type="plain",
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        initializer_range=hf.initializer_range,
        num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads,
        # as transformers' attention reads it: real Qwen2 / Qwen2.5 config.json files carry no head_dim
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        **rope_settings(hf),
        attention_bias=qkv_bias,
        attn_output_gate=False,
        qk_norm=qk_norm,
        mlp_type="dense",
        intermediate_size=hf.intermediate_size,
        mask_token_id=None,  # placed by the driver (plan_mask_token)
        **token_ids,
    )


class LlamaSource(HFSource):
    def __init__(self, src: Path) -> None:
        from transformers import LlamaConfig  # deferred: transformers, only when a checkpoint of this family is read

        raw, generation = read_hf_dir(src)
        if raw.get("model_type") != "llama":
            raise ValueError(f"{src}/config.json has model_type {raw.get('model_type')!r}; --from llama expects "
                             "'llama'")
        hf = LlamaConfig.from_dict(raw)
        self.config = llama_config(hf, special_token_ids(generation, raw))
        super().__init__(src, "model.", tie_word_embeddings=bool(hf.tie_word_embeddings))


def open_source(src: Path, source_format: str = "llama") -> LlamaSource:
    return LlamaSource(src)
