"""Rotary position embedding, full (Llama) or partial (Qwen3.5: the first 25 % of `head_dim`), rotate-half form."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        # A plain fp32 tensor, not a buffer: `model.to(torch.bfloat16)` must not round it — the angle p * f of
        # position p would be off by ~p * f / 256 radians (radians wrong at a few hundred tokens). Made on the CPU
        # (also when the model is built on the meta device) and moved to the positions' device on first use.
        steps = torch.arange(0, rotary_dim, 2, dtype=torch.float, device="cpu")
        self.inv_freq = 1.0 / (theta ** (steps / rotary_dim))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[N, T]` -> (cos, signed sin) `[N, 1, T, rotary_dim]`, ready to broadcast over heads.

        The signed sin is `[-sin | sin]` over the two halves (see `apply_rotary`)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[..., None].float() * self.inv_freq
        return torch.cat((freqs, freqs), dim=-1)[:, None].cos().to(dtype), \
            torch.cat((-freqs.sin(), freqs.sin()), dim=-1)[:, None].to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `rotary_dim` channels of `x` `[N, heads, T, head_dim]`; the rest pass through.

    Rotate-half RoPE is `x * cos + [-x2 | x1] * sin` for halves `x1, x2`; `[-x2 | x1] * sin` equals
    `roll(x, half) * [-sin | sin]` bit for bit (negation is exact), in three ops instead of five: this runs
    twice per attention layer and forward, where a small model's step is bound by per-op overhead."""
    rd = cos.shape[-1]
    rot = x if rd == x.shape[-1] else x[..., :rd]
    out = rot * cos + rot.roll(rd // 2, dims=-1) * signed_sin
    return out if rot is x else torch.cat((out, x[..., rd:]), dim=-1)
