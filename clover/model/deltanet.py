"""Gated DeltaNet, block-bidirectional (Clover) and exactly the AR base's on blocks of one token.

The AR base (Qwen3.5):
    q|k|v = silu(causal_conv(in_proj_qkv(x)))        depthwise, kernel K (4), channels q|k|v
    beta = sigmoid(in_proj_b(x));  g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)
    q, k L2-normalised, q scaled by dk^-0.5, q/k heads shared by Hv/Hk consecutive value heads (GVA)
    o = gated_delta_rule(q, k, v, g, beta);  y = out_proj(w * norm(o) * silu(in_proj_z(x)))

What Clover adds, inside a block of n tokens (docs/design.md §4; all identities at initialisation):
    * a right-context depthwise conv `conv1d_right` over positions i..i+K-1 of the block, zero-padded at the
      block's end, added to the causal conv before the SiLU (weights start at 0);
    * the block-bidirectional read of `clover.ops.delta_rule.block_bidirectional_read`, whose memory term is
      scaled by `lambda(n) = n ** memory_calibration[h]` (starts at 0, so lambda = 1; lambda(1) = 1 always);
    * the history stays the causal recurrent state: committing a block advances it by the ordinary rule.

With `deltanet_reading: causal` (arcLM's convention: only its attention layers read a block both ways) none of this
applies: the causal conv alone, and every block, committed or being decoded, read by the AR recurrence from the
state before it, so the layer is the AR base's whatever the block grid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from clover.config import CloverConfig
from clover.model.cache import DeltaNetLayerCache
from clover.model.layout import BlockLayout
from clover.model.norms import GatedRMSNorm
from clover.model.prompt_rows import is_reading_prompt
from clover.ops.delta_rule import (block_bidirectional_read, chunk_gated_delta_rule, l2norm,
                                   recurrent_gated_delta_rule)

PREFILL_CHUNK = 64  # chunk of the causal chunked rule
# up to this many causal tokens per row after a cached history (a decoding step; exact mode's verified drafts) run
# token by token in one C++ call (`GatedDeltaNet._fused_step`), each token with the bits it gets alone; longer
# runs (a prompt's chunks) take the chunked rule
FUSED_STEP_TOKENS = 16


class GatedDeltaNet(nn.Module):
    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.kernel = config.linear_conv_kernel_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.causal_read = config.deltanet_reading == "causal"
        h = config.hidden_size
        self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.conv1d_right = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.log(torch.empty(self.num_v_heads).uniform_(1.0, 16.0)))
        self.memory_calibration = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)
        nn.init.zeros_(self.conv1d_right.weight)
        # a one-token decoding step between the projections in one C++ call (`_fused_step`); set by
        # clover.model.quant, whose packed projections need the compiled kernels anyway
        self.fused_step = False

    # -- convolutions -------------------------------------------------------------------------------------
    def _right_conv(self, blocks: torch.Tensor) -> torch.Tensor:
        """`[M, C, n]` blocks -> sum_r w_r[c] x[c, i + r], zero past the block's end."""
        return F.conv1d(F.pad(blocks, (0, self.kernel - 1)), self.conv1d_right.weight, groups=self.conv_dim)

    def _blocked(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
        """`[N, C, L]` -> `[N * nb, C, block]`, zero-padding the last block."""
        n, c, length = x.shape
        pad = (-length) % block
        nb = (length + pad) // block
        x = F.pad(x, (0, pad)).view(n, c, nb, block).permute(0, 2, 1, 3).reshape(n * nb, c, block)
        return x, nb

    def _unblocked(self, x: torch.Tensor, n: int, length: int) -> torch.Tensor:
        c, block = x.shape[1], x.shape[2]
        return x.view(n, -1, c, block).permute(0, 2, 1, 3).reshape(n, c, -1)[:, :, :length]

    def _tail(self, full: torch.Tensor, clean_valid: torch.Tensor | None) -> torch.Tensor:
        """The last `K-1` real inputs of each row of `full` `[N, C, K-1 + clean]` (history first): the conv
        window of whatever comes next. Padding (input zero, marked in `clean_valid`) is skipped, so a row whose
        clean tokens are right-padded in a batch gets the window it would get alone."""
        k1 = self.kernel - 1
        if clean_valid is None or bool(clean_valid[:, -k1:].all()):
            return full[:, :, full.shape[2] - k1:]
        real = torch.cat([clean_valid.new_ones(full.shape[0], k1), clean_valid], dim=1)
        # a stable sort of `real` (False first) lists each row's padding, then its real columns in order
        index = torch.sort(real.int(), dim=1, stable=True).indices[:, -k1:]
        return full.gather(2, index[:, None].expand(-1, full.shape[1], -1))

    def _conv(self, mixed: torch.Tensor, layout: BlockLayout, history: torch.Tensor,
              clean_valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal conv (+ right-context conv inside blocks) over clean then query tokens, before the SiLU.

        `mixed` `[N, C, T]`, `history` `[N, C, K-1]`: the committed inputs before this pass. Returns the conv
        output `[N, C, T]` and the padded clean input `[N, C, K-1 + clean]` (`_tail` of it is the next history).
        """
        n, lc, bsz, k1 = mixed.shape[0], layout.clean_len, layout.block_size, self.kernel - 1
        clean = mixed[:, :, :lc]
        full = torch.cat([history, clean], dim=2)
        out = []
        if lc:
            p = layout.causal_len
            right = [clean[:, :, :p] * self.conv1d_right.weight[:, 0, :1]]  # blocks of one token: tap 0 only
            if layout.blocked_len:
                blocks, _ = self._blocked(clean[:, :, p:], bsz)
                right.append(self._unblocked(self._right_conv(blocks), n, layout.blocked_len))
            clean_out = F.conv1d(full, self.conv1d.weight, groups=self.conv_dim)
            out.append(clean_out if self.causal_read else clean_out + torch.cat(right, dim=2))
        if layout.query_blocks:
            starts = range(layout.query_start, layout.query_start + layout.query_len, bsz)
            windows = torch.stack([self._tail(full, clean_valid) if s == lc else full[:, :, s : s + k1]
                                   for s in starts], dim=1)  # [N, nq, C, K-1]
            query, nq = self._blocked(mixed[:, :, lc:], bsz)
            query_in = torch.cat([windows.reshape(n * nq, self.conv_dim, k1), query], dim=2)
            query_out = F.conv1d(query_in, self.conv1d.weight, groups=self.conv_dim)
            if not self.causal_read:
                query_out = query_out + self._right_conv(query)
            out.append(self._unblocked(query_out, n, layout.query_len))
        return torch.cat(out, dim=2), full

    # -- forward ------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, layout: BlockLayout, clean_valid: torch.Tensor | None,
                cache: DeltaNetLayerCache | None) -> torch.Tensor:
        n, t, _ = x.shape
        lc, p, bsz = layout.clean_len, layout.causal_len, layout.block_size
        # prompt chunks take the chunked rule however short: a prompt's state has the same bits however it is
        # served (clover.model.prompt_rows)
        if (self.fused_step and 0 < p == lc <= FUSED_STEP_TOKENS and (t == lc or layout.query_start == lc)
                and (clean_valid is None or bool(clean_valid.all()))
                and cache is not None and cache.state is not None and x.dtype == torch.float32
                and x.device.type == "cpu" and not (x.requires_grad and torch.is_grad_enabled())
                and not is_reading_prompt()):
            clean = self._fused_step(x[:, :lc], cache)
            if t == lc:
                return clean
            # a query block after them (exact mode's drafting) reads the state they left, as the module path does
            query = BlockLayout(0, bsz, query_blocks=layout.query_blocks)
            return torch.cat([clean, self.forward(x[:, lc:], query, None, cache)], dim=1)
        if layout.causal_clean and layout.query_blocks and layout.query_start < lc:
            # the query blocks would need the causal recurrence's state at each block start of the clean stream
            raise ValueError("Gated DeltaNet reads committed context block-causally: context_reading='causal' "
                             "with query blocks inside the clean stream (the training layout) is supported for "
                             "attention layers only")
        mixed = self.in_proj_qkv(x)
        beta = torch.sigmoid(self.in_proj_b(x).float())
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        if clean_valid is not None:  # left padding: no conv input, no decay, no write
            valid = torch.cat([clean_valid, clean_valid.new_ones(n, t - lc)], dim=1)
            mixed = mixed * valid[..., None].to(mixed.dtype)
            beta, g = beta * valid[..., None], g * valid[..., None]

        has_history = cache is not None and cache.state is not None
        history = cache.conv if has_history else mixed.new_zeros(n, self.conv_dim, self.kernel - 1)
        conv_out, full = self._conv(mixed.transpose(1, 2), layout, history, clean_valid)
        q, k, v = F.silu(conv_out).transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = self.num_v_heads // self.num_k_heads
        q = q.reshape(n, t, self.num_k_heads, self.head_k_dim).repeat_interleave(rep, dim=2)
        k = k.reshape(n, t, self.num_k_heads, self.head_k_dim).repeat_interleave(rep, dim=2)
        v = v.reshape(n, t, self.num_v_heads, self.head_v_dim)
        q = l2norm(q.float()).transpose(1, 2) * self.head_k_dim ** -0.5
        k = l2norm(k.float()).transpose(1, 2)
        v = v.float().transpose(1, 2)
        g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # [N, Hv, T]

        state = cache.state if has_history else q.new_zeros(n, self.num_v_heads, self.head_k_dim, self.head_v_dim)
        if cache is not None and lc:
            cache.record(state, full, k[:, :, :lc], v[:, :, :lc], g[:, :, :lc], beta[:, :, :lc])
        outs = []
        if p:  # causal prefix: the AR recurrence
            sl = slice(0, p)
            if p == 1:
                o, state = recurrent_gated_delta_rule(q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl],
                                                      beta[:, :, sl], state)
            else:
                o, state, _ = chunk_gated_delta_rule(q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl],
                                                     beta[:, :, sl], state, chunk_size=min(PREFILL_CHUNK, p))
            outs.append(o)
        starts = state[:, :, None]  # history state before each clean block, then the final state
        if layout.blocked_len:
            sl = slice(p, lc)
            o, final, block_states = chunk_gated_delta_rule(q[:, :, sl] if self.causal_read else None, k[:, :, sl],
                                                            v[:, :, sl], g[:, :, sl], beta[:, :, sl], state,
                                                            chunk_size=bsz, chunk_states=True)
            if not self.causal_read:
                nb = block_states.shape[2]
                sizes = torch.full((nb,), float(bsz), device=x.device)
                sizes[-1] = layout.blocked_len - (nb - 1) * bsz
                o = self._read(q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl], block_states,
                               sizes, bsz)
            outs.append(o[:, :, : layout.blocked_len])
            starts = torch.cat([block_states, final[:, :, None]], dim=2)
            state = final
        if layout.query_blocks:
            sl = slice(lc, t)
            first = (layout.query_start - p) // bsz if layout.query_start < lc else starts.shape[2] - 1
            idx = torch.arange(first, first + layout.query_blocks, device=x.device)
            past_clean = torch.arange(layout.query_blocks, device=x.device) * bsz + layout.query_start >= lc
            idx[past_clean] = starts.shape[2] - 1
            if self.causal_read:
                outs.append(self._read_causal(q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl],
                                              starts[:, :, idx], bsz))
            else:
                sizes = torch.full((layout.query_blocks,), float(bsz), device=x.device)
                outs.append(self._read(q[:, :, sl], k[:, :, sl], v[:, :, sl], g[:, :, sl], beta[:, :, sl],
                                       starts[:, :, idx], sizes, bsz))

        if cache is not None and lc:
            cache.state = state
            cache.conv = self._tail(full, clean_valid).clone()

        o = torch.cat(outs, dim=2).transpose(1, 2).to(x.dtype)  # [N, T, Hv, dv]
        z = self.in_proj_z(x).view(n, t, self.num_v_heads, self.head_v_dim)
        return self.out_proj(self.norm(o, z).reshape(n, t, self.value_dim))

    def _fused_step(self, x: torch.Tensor, cache: DeltaNetLayerCache) -> torch.Tensor:
        """`x [N, T, H]`: causal tokens after each row's cached history, stepped token by token between the
        projections by `clover/ops/csrc/deltanet.cpp`: the conv, the recurrence and the gated norm (the math of
        `forward`'s path through `recurrent_gated_delta_rule`, to fp32 rounding: tests/model/test_deltanet_step.py);
        a token computes the same bits whether its forward holds it alone or after others (exact mode's verified
        drafts as block size 1's steps)."""
        from clover.ops import woq  # deferred: the extension is compiled on first use

        mixed = self.in_proj_qkv(x)
        y, state, window, states = woq.extension().deltanet_step(
            mixed, self.in_proj_z(x), self.in_proj_a(x), self.in_proj_b(x), cache.conv.contiguous(),
            self.conv1d.weight, None if self.causal_read else self.conv1d_right.weight, self.A_log, self.dt_bias,
            self.norm.weight, self.norm.eps, cache.state.contiguous(), self.num_k_heads, self.head_k_dim,
            self.head_v_dim, cache.recording)
        if cache.recording:  # the state after each token, kept for a rewind to pick from
            cache.record_steps(cache.state, torch.cat([cache.conv, mixed.transpose(1, 2)], dim=2), states)
        cache.state, cache.conv = state, window
        return self.out_proj(y)

    def _read(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              states: torch.Tensor, sizes: torch.Tensor, bsz: int) -> torch.Tensor:
        """Block-bidirectional outputs of consecutive blocks of `bsz` `[N, H, L, d]` (the last may be short)
        -> `[N, H, nb * bsz, dv]`."""
        n, h, length, _ = q.shape
        nb = states.shape[2]
        pad = nb * bsz - length
        blocks = [F.pad(x, (0, 0, 0, pad)).view(n, h, nb, bsz, -1) for x in (q, k, v)]
        g, beta = (F.pad(x, (0, pad)).view(n, h, nb, bsz) for x in (g, beta))
        scale = torch.exp(self.memory_calibration.float()[:, None] * sizes.log()[None, :])  # lambda(n) [H, nb]
        out = block_bidirectional_read(*blocks, g, beta, states, scale)
        return out.reshape(n, h, nb * bsz, -1)

    @staticmethod
    def _read_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, bsz: int) -> torch.Tensor:
        """Causal outputs of consecutive whole blocks of `bsz` `[N, H, nb * bsz, d]`, each block's recurrence
        started from its own state `states[:, :, b]` -> `[N, H, nb * bsz, dv]`."""
        n, h, length, _ = q.shape
        nb = states.shape[2]

        def fold(x: torch.Tensor) -> torch.Tensor:  # [N, H, nb * bsz, ...] -> [N * nb, H, bsz, ...]
            return x.reshape(n, h, nb, bsz, *x.shape[3:]).transpose(1, 2).reshape(n * nb, h, bsz, *x.shape[3:])

        start = states.transpose(1, 2).reshape(n * nb, h, *states.shape[3:])
        out, _, _ = chunk_gated_delta_rule(fold(q), fold(k), fold(v), fold(g), fold(beta), start, chunk_size=bsz)
        return out.reshape(n, nb, h, bsz, -1).transpose(1, 2).reshape(n, h, length, -1)
