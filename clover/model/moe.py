"""Feed-forward blocks: dense SwiGLU, and the sparse MoE: softmax top-k router, routed experts, and the sigmoid-gated
shared expert of Qwen3.5 (Qwen3-MoE has none: `shared_expert_intermediate_size` 0)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from clover.config import CloverConfig


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate and up as one projection (clover.model.quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TopKRouter(nn.Module):
    """Router logits `x W^T`; softmax in fp32; top-k; weights renormalised to sum to 1 (`norm_topk_prob`)."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.normalize = config.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(x, self.weight).softmax(dim=-1, dtype=torch.float)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts


def run_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor) -> torch.Tensor:
    """x `[tokens, H]`; each token's output is the weighted sum of its top-k experts' outputs (`gate_up [E, 2I, H]`,
    gate rows then up; `down [E, H, I]`), one matmul per expert over the tokens routed to it."""
    out = torch.zeros_like(x)
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    token_of = order // experts.shape[1]
    weight_of = weights.flatten()[order]
    start = 0
    for e, count in enumerate(counts):  # one matmul per expert that has tokens
        if count == 0:
            continue
        idx = token_of[start : start + count]
        gate, up = F.linear(x[idx], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weight_of[start : start + count, None]
        out.index_add_(0, idx, y.to(out.dtype))
        start += count
    return out


class Experts(nn.Module):
    """Routed SwiGLU experts stored fused: `gate_up_proj` `[E, 2I, H]` (gate rows, then up), `down_proj` `[E, H, I]`.
    (Quantised, they are `clover.model.quant.PackedExperts`, which the whole layer may run as one C++ call.)"""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return run_experts(x, weights, experts, self.gate_up_proj, self.down_proj)

    def grouped(self, moe: SparseMoE, x: torch.Tensor) -> torch.Tensor | None:
        """The whole layer in one call, where the experts' form has one (`PackedExperts`); here: none."""
        return None


class SparseMoE(nn.Module):
    """`sum_k w_k expert_k(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)`, the second term only with a
    shared expert."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = Experts(config)
        self.shared_expert: SwiGLU | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        out = self.experts.grouped(self, x)
        if out is not None:
            return out.reshape(shape)
        weights, experts = self.gate(x)
        out = self.experts(x, weights, experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)
