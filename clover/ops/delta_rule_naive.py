"""Naive reference for `clover.ops.delta_rule`: the block-bidirectional read written as it reads, token by token.

Slow and obvious on purpose (flash-linear-attention keeps its `naive.py` the same way): `tests/model/test_ops.py` proves
the batched form the model runs equals it. Math and layout: `clover.ops.delta_rule`, docs/design.md §4.
"""

from __future__ import annotations

import torch


def naive_block_bidirectional_read(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, memory_scale: torch.Tensor,
) -> torch.Tensor:
    """One block, written as the formula reads, token by token (reference). Shapes `[N, H, n, d]`."""
    n_tok = q.shape[2]
    G = g.cumsum(-1)
    out = torch.zeros_like(v)
    for i in range(n_tok):
        read = torch.einsum("nhkv,nhk->nhv", state, q[:, :, i])
        out[:, :, i] = memory_scale[..., None] * G[:, :, i, None].exp() * read
        for j in range(n_tok):
            hist = torch.einsum("nhkv,nhk->nhv", state, k[:, :, j]) * G[:, :, j, None].exp()
            u_j = beta[:, :, j, None] * (v[:, :, j] - hist)
            weight = (q[:, :, i] * k[:, :, j]).sum(-1) * torch.exp(-(G[:, :, i] - G[:, :, j]).abs())
            out[:, :, i] += weight[..., None] * u_j
    return out
