"""Softmax attention: Qwen3.5's gated attention, or Llama's plain attention, under a block layout.

Gated form (Qwen3.5): `q_proj` yields per head `[query | gate]`; q and k get a zero-centred RMSNorm over
`head_dim`; RoPE rotates the first `rotary_dim` channels; GQA shares each k/v head across
`heads / kv_heads` query heads; the output is multiplied by `sigmoid(gate)` before `o_proj`.
Plain form (Llama): no gate, no q/k norm, full RoPE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from clover.config import CloverConfig
from clover.model.cache import AttentionLayerCache
from clover.model.norms import RMSNorm
from clover.model.rope import apply_rotary


class Attention(nn.Module):
    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.output_gate = config.attn_output_gate
        q_out = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        self.q_proj = nn.Linear(config.hidden_size, q_out, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        # q/k/v as one projection (set by clover.model.quant, which removes the three): one weight stream
        self.qkv_proj: nn.Module | None = None
        self.qkv_sizes = [q_out, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim]
        if config.qk_norm:
            zc = config.norm_type == "zero_centered"
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, zero_centered=zc)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, zero_centered=zc)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                is_causal: bool, clean_len: int, cache: AttentionLayerCache | None) -> torch.Tensor:
        """x `[N, T, hidden]` (clean then query tokens); the first `clean_len` keys/values go to the cache."""
        n, t, _ = x.shape
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(n, t, self.num_heads, -1)
        gate = None
        if self.output_gate:
            q, gate = q.chunk(2, dim=-1)
            gate = gate.reshape(n, t, -1)
        k = k.view(n, t, self.num_kv_heads, self.head_dim)
        v = v.view(n, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # q and k rotated as one tensor of heads + kv_heads: one RoPE instead of two (per-op overhead dominates a
        # small model's decoding step on a CPU)
        qk = apply_rotary(torch.cat((q, k), dim=2).transpose(1, 2), *rope)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = v.transpose(1, 2)

        keys, values = k, v
        if cache is not None:
            keys, values = cache.extend(k, v, clean_len)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=is_causal,
                                             enable_gqa=self.num_kv_heads != self.num_heads)
        out = out.transpose(1, 2).reshape(n, t, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)
