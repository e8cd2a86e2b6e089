"""Qwen3-Next HF checkpoints (`Qwen3NextForCausalLM`) -> Clover.

Qwen3-Next is Qwen3.5-MoE's predecessor with the same blocks (checked against transformers' modelling
files): gated attention with zero-centred q/k norms and partial RoPE, zero-centred RMSNorms, the gated
RMSNorm on the DeltaNet output, the sigmoid-gated shared expert, the same GVA grouping (`repeat_interleave`
of q/k heads over consecutive value heads). Three things differ:

1. **Interleaved DeltaNet projections.** `in_proj_qkvz` `[2*Hk*dk + 2*Hv*dv, H]` is grouped per key head:
   with `r = Hv / Hk`, its rows are `Hk` groups of `[q (dk) | k (dk) | v (r*dv) | z (r*dv)]`, and value head
   `j = kh*r + t` is sub-head `t` of group `kh`. `in_proj_ba` `[2*Hv, H]` is `Hk` groups of `[b (r) | a (r)]`.
   Clover's (= Qwen3.5's) `in_proj_qkv` is `[q of all heads | k of all heads | v of all heads]` (head-major
   inside each), `in_proj_z` / `in_proj_b` / `in_proj_a` list value heads in order `j`. Since value heads of
   one group are consecutive in both layouts, splitting each group and concatenating over groups is exact
   (`split_qkvz`, `split_ba`); the conv1d channel order is q|k|v in both, so it is copied.
2. **Router normalisation** is optional (`norm_topk_prob`, copied).
3. **Dense layers.** Layer `i` is a dense SwiGLU of width `intermediate_size` when `i in mlp_only_layers`
   or `(i + 1) % decoder_sparse_step != 0` (or the model has no experts); Clover lists them all in
   `mlp_only_layers` (`common.dense_mlp_layers`).

The published config.json has no `layer_types`: transformers' config class derives them from
`full_attention_interval` (every 4th layer full attention) and reads `rope_theta` / `partial_rotary_factor` (default
0.25) from the top level into `rope_parameters`; the conversion reads the config object, so it sees the same.
"""

from __future__ import annotations

from pathlib import Path

import torch

from clover.conversion.common import HFSource, dense_mlp_layers, read_hf_dir, special_token_ids
from clover.conversion.qwen3_5 import hybrid_config

_SPLIT = {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"}


def split_qkvz(weight: torch.Tensor, num_k_heads: int, head_k_dim: int, num_v_heads: int,
               head_v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next `in_proj_qkvz` -> (Clover `in_proj_qkv`, `in_proj_z`); see the module docstring."""
    r = num_v_heads // num_k_heads
    groups = weight.reshape(num_k_heads, 2 * head_k_dim + 2 * r * head_v_dim, -1)
    q, k, v, z = torch.split(groups, [head_k_dim, head_k_dim, r * head_v_dim, r * head_v_dim], dim=1)
    hidden = weight.shape[-1]
    qkv = torch.cat([q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)])
    return qkv, z.reshape(-1, hidden)


def split_ba(weight: torch.Tensor, num_k_heads: int, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next `in_proj_ba` -> (Clover `in_proj_b`, `in_proj_a`); see the module docstring."""
    r = num_v_heads // num_k_heads
    b, a = torch.split(weight.reshape(num_k_heads, 2 * r, -1), [r, r], dim=1)
    return b.reshape(num_v_heads, -1), a.reshape(num_v_heads, -1)


class Qwen3NextSource(HFSource):
    def __init__(self, src: Path) -> None:
        from transformers import Qwen3NextConfig  # deferred: transformers, only when a checkpoint of this family is read

        raw, generation = read_hf_dir(src)
        if raw.get("model_type") != "qwen3_next":
            raise ValueError(f"{src}/config.json has model_type {raw.get('model_type')!r}; --from qwen3_next "
                             "expects 'qwen3_next'")
        hf = Qwen3NextConfig.from_dict(raw)
        n = hf.num_hidden_layers
        dense = dense_mlp_layers(hf)
        overrides: dict = dict(norm_topk_prob=bool(hf.norm_topk_prob), mlp_only_layers=dense,
                               intermediate_size=hf.intermediate_size if dense else 0)
        if len(dense) == n:  # no sparse layer at all: a dense model
            overrides.update(mlp_type="dense", mlp_only_layers=[])
        self.config = hybrid_config(hf, special_token_ids(generation, raw), bool(hf.tie_word_embeddings),
                                    **overrides)
        super().__init__(src, "model.", ignore=lambda name: name.startswith("mtp."),
                         tie_word_embeddings=bool(hf.tie_word_embeddings))

    def tensor(self, name: str) -> torch.Tensor:
        module, _, leaf = name.rpartition(".")  # e.g. model.layers.0.linear_attn.in_proj_qkv . weight
        base, _, proj = module.rpartition(".")
        if not (base.endswith(".linear_attn") and proj in _SPLIT) or self.source_name(name) in self.reader:
            return super().tensor(name)
        c = self.config
        if proj in ("in_proj_qkv", "in_proj_z"):
            fused = self.reader.get(self.source_name(f"{base}.in_proj_qkvz.{leaf}"), wanted_by=name)
            qkv, z = split_qkvz(fused, c.linear_num_key_heads, c.linear_key_head_dim, c.linear_num_value_heads,
                                c.linear_value_head_dim)
            return qkv if proj == "in_proj_qkv" else z
        fused = self.reader.get(self.source_name(f"{base}.in_proj_ba.{leaf}"), wanted_by=name)
        b, a = split_ba(fused, c.linear_num_key_heads, c.linear_num_value_heads)
        return b if proj == "in_proj_b" else a


def open_source(src: Path, source_format: str = "qwen3_next") -> Qwen3NextSource:
    return Qwen3NextSource(src)
