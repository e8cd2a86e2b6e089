"""Gated delta rule: the math of Gated DeltaNet on tensors, causal and block-bidirectional.

All functions take heads already expanded to the value heads, q/k already L2-normalised and q scaled,
laid out as `[batch, heads, time, dim]` in fp32, `g` (log-decay, <= 0) and `beta` as `[batch, heads, time]`,
and states `S` of shape `[batch, heads, dk, dv]`.

Causal recurrence (the AR base), per head:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,     o_t = S_t^T q_t

Block-bidirectional read (Clover, docs/design.md §4), for the `n` tokens of one block with history state `S_h` and
in-block cumulative log-decay `G_i = sum_{t <= i} g_t`:

    o_i = lambda(n) exp(G_i) S_h^T q_i + sum_j exp(-|G_i - G_j|) (q_i . k_j) u_j,
    u_j = beta_j (v_j - exp(G_j) S_h^T k_j)

With n = 1 both give the same output; a block's commit advances `S_h` by the causal recurrence.

`recurrent_gated_delta_rule` is the token-by-token recurrence: the single-token decoding step, and the reference the
chunked form is tested against. `clover.ops.delta_rule_naive` writes the block read token by token, as the formula
reads (the tests' reference); the batched forms here are the ones the model runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps), as flash-linear-attention and the AR reference compute it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token causal recurrence: the reference, and the single-token decoding step."""
    n, h, t, dk = k.shape
    state = q.new_zeros(n, h, dk, v.shape[-1]) if initial_state is None else initial_state
    out = torch.empty_like(v)
    for i in range(t):
        state = state * g[:, :, i].exp()[..., None, None]
        delta = (v[:, :, i] - torch.einsum("nhkv,nhk->nhv", state, k[:, :, i])) * beta[:, :, i, None]
        state = state + k[:, :, i, :, None] * delta[:, :, None, :]
        out[:, :, i] = torch.einsum("nhkv,nhk->nhv", state, q[:, :, i])
    return out, state


def _pad_time(x: torch.Tensor, pad: int, dim: int) -> torch.Tensor:
    if pad == 0:
        return x
    widths = [0, 0] * (x.dim() - 1 - dim) + [0, pad]
    return F.pad(x, widths)


def chunk_gated_delta_rule(
    q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None, chunk_size: int = 64, chunk_states: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Causal gated delta rule, chunked (WY / UT-transform form).

    Within a chunk of size C with cumulative decay G, the delta-rule updates collapse to
    `T u = beta v - beta exp(G) k S` with `T = I + tril(beta_i exp(G_i - G_j) k_i.k_j, -1)`, so the chunk
    needs two triangular solves and a few matmuls; only the state crosses chunks.

    Returns `(out, final_state, states)`: `out` is None when `q` is None (state-only, e.g. a block commit);
    `states` (`[batch, heads, chunks, dk, dv]`, the state *before* each chunk) when `chunk_states`.
    Padding to a multiple of `chunk_size` uses g = beta = 0, which leaves the state unchanged.
    """
    n, h, t, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk_size
    k, v = _pad_time(k, pad, 2), _pad_time(v, pad, 2)
    g, beta = _pad_time(g, pad, 2), _pad_time(beta, pad, 2)
    nc = (t + pad) // chunk_size
    shape = (n, h, nc, chunk_size)
    k, v = k.reshape(*shape, dk), v.reshape(*shape, dv)
    G = g.reshape(shape).cumsum(-1)
    beta = beta.reshape(shape)

    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=k.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # unit lower-triangular after adding I - diag
    system = system.tril(-1) + torch.eye(chunk_size, dtype=k.dtype, device=k.device)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * G.exp()[..., None], upper=False, unitriangular=True)

    state = k.new_zeros(n, h, dk, dv) if initial_state is None else initial_state.to(k.dtype)
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = G[..., -1].exp()[..., None, None]
    if q is not None:
        q = _pad_time(q, pad, 2).reshape(*shape, dk)
        attn = (q @ k.transpose(-1, -2)) * decay
        q = q * G.exp()[..., None]
        out = torch.empty(n, h, nc, chunk_size, dv, dtype=v.dtype, device=v.device)
    states = torch.empty(n, h, nc, dk, dv, dtype=k.dtype, device=k.device) if chunk_states else None
    for c in range(nc):
        if states is not None:
            states[:, :, c] = state
        v_new = u[:, :, c] - w[:, :, c] @ state
        if q is not None:
            out[:, :, c] = q[:, :, c] @ state + attn[:, :, c] @ v_new
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ v_new
    if q is not None:
        out = out.reshape(n, h, nc * chunk_size, dv)[:, :, :t]
        return out, state, states
    return None, state, states


def block_bidirectional_read(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, memory_scale: torch.Tensor,
) -> torch.Tensor:
    """Outputs of many blocks at once, each reading its own history state (docs/design.md §4).

    Shapes: q, k `[N, H, nb, n, dk]`, v `[N, H, nb, n, dv]`, g, beta `[N, H, nb, n]`, states
    `[N, H, nb, dk, dv]` (the state before each block), memory_scale `lambda(n)` broadcastable to `[N, H, nb]`.
    Padding positions (g = beta = 0, k = v = 0) contribute nothing.
    """
    G = g.cumsum(-1)
    eG = G.exp()[..., None]
    memory = (q @ states) * eG * memory_scale[..., None, None]
    u = beta[..., None] * (v - (k @ states) * eG)
    decay = torch.exp(-(G[..., :, None] - G[..., None, :]).abs())
    return memory + ((q @ k.transpose(-1, -2)) * decay) @ u
