"""Rotary position embedding, full (Llama) or partial (Qwen3.5: the first 25 % of `head_dim`), rotate-half form,
with Llama 3's frequency-dependent scaling where a checkpoint carries it (`rope_scaling`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from clover.config import LLAMA3_ROPE_FIELDS


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> torch.Tensor:
    """Llama 3's RoPE scaling (rope_type "llama3", as transformers' `_compute_llama3_parameters` computes it).

    With `L` = original_max_position_embeddings and wavelength `w = 2 pi / f` of frequency `f`: high frequencies
    (`w < L / high_freq_factor`) stay, low ones (`w > L / low_freq_factor`) are divided by `factor`, and those in
    between are interpolated, `f' = (1 - s) f / factor + s f` with `s = (L / w - low_freq_factor) /
    (high_freq_factor - low_freq_factor)`. cos / sin are not rescaled (attention factor 1)."""
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """The `rotary_dim / 2` inverse frequencies `theta^(-2i / rotary_dim)`, Llama-3-scaled when `scaling` is set
    (CloverConfig.rope_scaling: rope_type "llama3" and LLAMA3_ROPE_FIELDS)."""
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.float, device="cpu")
    inv_freq = 1.0 / (theta ** (steps / rotary_dim))
    if scaling is None:
        return inv_freq
    return llama3_inv_freq(inv_freq, **{name: scaling[name] for name in LLAMA3_ROPE_FIELDS})


def rope_freq_factors(rotary_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """What each plain frequency is divided by under `scaling`: llama.cpp's `rope_freqs` tensor (ggml's rope
    divides `theta^(-2i / d)` by factor `i`), as llama.cpp's converter writes it for Llama 3."""
    return rope_inv_freq(rotary_dim, theta) / rope_inv_freq(rotary_dim, theta, scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        # A plain fp32 tensor, not a buffer: `model.to(torch.bfloat16)` must not round it — the angle p * f of
        # position p would be off by ~p * f / 256 radians (radians wrong at a few hundred tokens). Made on the CPU
        # (also when the model is built on the meta device) and moved to the positions' device on first use.
        self.inv_freq = rope_inv_freq(rotary_dim, theta, scaling)

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
