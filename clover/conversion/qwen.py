"""Qwen3 (dense) and Qwen2 / Qwen2.5 HF checkpoints -> Clover's dense backbone.

Both are Llama-form, with Llama's tensor names, and differ from it in one place each:

* **Qwen3** (`Qwen3ForCausalLM`) RMS-normalises each head's queries and keys over `head_dim` before RoPE
  (`self_attn.q_norm` / `k_norm`, plain `norm(x) * w`): Clover's `qk_norm` with `norm_type: plain`. Its
  `attention_bias` would also put a bias on `o_proj`, which Clover has not: refused.
* **Qwen2** (`Qwen2ForCausalLM`, the Qwen2.5 family) adds biases to q, k and v (never to o): Clover's
  `attention_bias`.

Sliding-window layers (`use_sliding_window`, `layer_types` with `sliding_attention`) and RoPE scaling (YaRN
and the like) are refused: Clover reads every layer with full attention and plain RoPE. Block-diffusion
checkpoints built on these bases (SDAR, Fast-dLLM v2) carry the same layout but other conventions; this module
converts AR bases, which the training recipe then adapts.
"""

from __future__ import annotations

from pathlib import Path

from clover.conversion.common import HFSource, read_hf_dir, special_token_ids
from clover.conversion.llama import dense_config


class QwenSource(HFSource):
    """`model_type` is the base layout ("qwen3" / "qwen2"); `released` the config.json `model_type` a checkpoint
    in that layout carries (a block-diffusion family's: clover.conversion.released), by default the base's own."""

    def __init__(self, src: Path, model_type: str, released: str | None = None) -> None:
        from transformers import Qwen2Config, Qwen3Config  # deferred: transformers (~1 s), only when a checkpoint of this family is read

        raw, generation = read_hf_dir(src)
        expected = released or model_type
        if raw.get("model_type") != expected:
            raise ValueError(f"{src}/config.json has model_type {raw.get('model_type')!r}; --from {expected} "
                             f"expects {expected!r}")
        fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", "architectures")}
        hf = (Qwen3Config if model_type == "qwen3" else Qwen2Config).from_dict(fields)
        sliding = [i for i, kind in enumerate(getattr(hf, "layer_types", None) or []) if kind != "full_attention"]
        if getattr(hf, "use_sliding_window", False) or sliding:
            raise ValueError(f"sliding-window attention (layers {sliding or 'per use_sliding_window'}) is not "
                             "supported: Clover reads every layer with full attention")
        if model_type == "qwen3" and hf.attention_bias:
            raise ValueError("attention_bias is not supported for qwen3: it also biases o_proj, which Clover's "
                             "dense backbone has not")
        self.config = dense_config(hf, special_token_ids(generation, raw), qkv_bias=model_type == "qwen2",
                                   qk_norm=model_type == "qwen3")
        super().__init__(src, "model.", tie_word_embeddings=bool(hf.tie_word_embeddings))
