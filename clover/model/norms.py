"""RMS norms: zero-centred (Qwen3.5), plain (Llama), and the gated output norm of Gated DeltaNet."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """`y = x / rms(x) * (1 + w)` (zero-centred, `w` starts at 0) or `y = x / rms(x) * w` (plain, `w` starts at 1).

    Normalisation runs in fp32; the weight is applied where each reference applies it (Qwen in fp32, then cast;
    Llama after casting back), so bf16 results match their AR bases too.
    """

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm normalises in fp32 and multiplies by the weight before casting back: one op instead of six
        # (a small model's CPU step is bound by per-op overhead), exact where that order is the reference's
        if self.zero_centered:
            return F.rms_norm(x.float(), self.weight.shape, 1.0 + self.weight.float(), self.eps).type_as(x)
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)  # Llama: cast, scale

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, zero_centered={self.zero_centered}"


class GatedRMSNorm(nn.Module):
    """DeltaNet output norm: `y = w * (o / rms(o)) * silu(z)`, plain weight starting at 1."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)
