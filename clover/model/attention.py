"""Softmax attention: Qwen3.5's gated attention, or Llama's plain attention, under a block layout.

Gated form (Qwen3.5): `q_proj` yields per head `[query | gate]`; q and k get a zero-centred RMSNorm over
`head_dim`; RoPE rotates the first `rotary_dim` channels; GQA shares each k/v head across
`heads / kv_heads` query heads; the output is multiplied by `sigmoid(gate)` before `o_proj`.
Plain form (Llama): no gate, no q/k norm, full RoPE.

A forward's causal clean rows (block size 1, exact mode's verified drafts) get the bits each would get in a forward of
its own (`CleanRows`): softmax attention over `k` query rows in one call sums in another order than over one row,
so without this a draft's verification could flip a near-tie that block size 1 decides the other way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from clover.config import CloverConfig
from clover.model.cache import AttentionLayerCache
from clover.model.norms import RMSNorm
from clover.model.rope import apply_rotary


ROWS_ALONE = 16  # causal clean rows after a cache up to this many attend one at a time (exact mode's verification)


@dataclass
class CleanRows:
    """How a forward's clean rows attend when they are all causal (`clover.model.modeling`): apart from the query
    rows beside them, with the mask a forward of the clean rows alone has (`mask`, `is_causal`); and with `alone`
    (a few rows after a cache) each row by itself over the keys up to its own, with the mask a one-row forward at
    its position has (None where no row is padded), so that every row has the bits a block-size-1 step gives it."""

    mask: torch.Tensor | None
    is_causal: bool
    alone: list[torch.Tensor | None] | None = None


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
           clean_len: int, clean_rows: CleanRows | None) -> torch.Tensor:
    """Softmax attention of `q` `[N, H, T, D]` (clean rows, then query rows) over `keys`, `values` (the cache's, then
    the T new ones); with `clean_rows`, the clean rows as it says."""
    gqa = keys.shape[1] != q.shape[1]
    if clean_rows is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa)
    past = keys.shape[2] - q.shape[2]
    parts = []
    if clean_rows.alone is not None:
        for i, row_mask in enumerate(clean_rows.alone):
            end = past + i + 1
            parts.append(F.scaled_dot_product_attention(q[:, :, i : i + 1], keys[:, :, :end], values[:, :, :end],
                                                        attn_mask=row_mask, enable_gqa=gqa))
    elif clean_len:
        end = past + clean_len
        parts.append(F.scaled_dot_product_attention(q[:, :, :clean_len], keys[:, :, :end], values[:, :, :end],
                                                    attn_mask=clean_rows.mask, is_causal=clean_rows.is_causal,
                                                    enable_gqa=gqa))
    if q.shape[2] > clean_len:  # the query rows: their bits are drafts', which nothing compares
        parts.append(F.scaled_dot_product_attention(q[:, :, clean_len:], keys, values, attn_mask=mask[:, :, clean_len:],
                                                    enable_gqa=gqa))
    return torch.cat(parts, dim=2)


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
                is_causal: bool, clean_len: int, cache: AttentionLayerCache | None,
                clean_rows: CleanRows | None = None) -> torch.Tensor:
        """x `[N, T, hidden]` (clean then query tokens); the first `clean_len` keys/values go to the cache;
        `clean_rows`: how the clean rows attend, where not with the query rows in one call (`attend`)."""
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
        out = attend(q, keys, values, mask, is_causal, clean_len, clean_rows)
        out = out.transpose(1, 2).reshape(n, t, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)
