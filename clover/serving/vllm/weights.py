"""A Clover checkpoint's tensors -> the causal path's tensors under the names vLLM's own models load.

Clover names its tensors as transformers does for the AR base (Llama; Qwen3.5 for the hybrids), so most pass
through unchanged. What differs is what Clover adds for query (masked or drafted) positions, and two layouts:

* a gated adapter (`lora_A`, `lora_B`, `row_delta`, in adapter.safetensors) acts at query positions only, so the
  causal path is the base without it: its tensors are dropped (an ungated one is refused by `check_checkpoint`);
* a Gated DeltaNet layer's right-context conv reads positions i..i+K-1 of a block; in blocks of one token only
  its tap 0 remains, a per-channel term `r0[c] x[c, i]` added to the causal conv, whose tap K-1 multiplies the same
  `x[c, i]`: folded in, `w[c, K-1] += r0[c]` (with `deltanet_reading: causal` the right conv is not applied at all);
* `memory_calibration` scales the block-bidirectional read by `n ** m`, which is 1 for n = 1: dropped;
* the hybrids run on vLLM's Qwen3-Next model (its Qwen3.5 one imports a vision stack), whose DeltaNet input
  projections are fused per key head: `in_proj_qkvz` is `Hk` groups of `[q (dk) | k (dk) | v (r dv) | z (r dv)]`
  and `in_proj_ba` `Hk` groups of `[b (r) | a (r)]`, `r = Hv / Hk` (the inverse of
  clover.conversion.qwen3_next's split);
* routed experts, stored fused (`mlp.experts.gate_up_proj` `[E, 2I, H]`: gate rows then up; `down_proj`
  `[E, H, I]`), are given per expert (`mlp.experts.N.{gate,up,down}_proj.weight`), the layout vLLM's fused-MoE
  loader maps onto its own (sharded) expert tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from clover.config import CloverConfig

ADAPTER_SUFFIXES = (".lora_A", ".lora_B", ".row_delta")
_LA = ".linear_attn."


def join_qkvz(qkv: torch.Tensor, z: torch.Tensor, num_k_heads: int, head_k_dim: int) -> torch.Tensor:
    """(Clover `in_proj_qkv` `[2 Hk dk + Hv dv, H]`, `in_proj_z` `[Hv dv, H]`) -> Qwen3-Next `in_proj_qkvz`."""
    hidden, key = qkv.shape[-1], num_k_heads * head_k_dim
    q, k, v = qkv[:key], qkv[key:2 * key], qkv[2 * key:]
    parts = [t.reshape(num_k_heads, -1, hidden) for t in (q, k, v, z)]
    return torch.cat(parts, dim=1).reshape(-1, hidden)


def join_ba(b: torch.Tensor, a: torch.Tensor, num_k_heads: int) -> torch.Tensor:
    """(Clover `in_proj_b` `[Hv, H]`, `in_proj_a` `[Hv, H]`) -> Qwen3-Next `in_proj_ba`."""
    hidden = b.shape[-1]
    groups = [b.reshape(num_k_heads, -1, hidden), a.reshape(num_k_heads, -1, hidden)]
    return torch.cat(groups, dim=1).reshape(-1, hidden)


def _fold_right_conv(conv: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """The causal conv `[C, 1, K]` with the right conv's tap 0 added to its last tap (the current position)."""
    out = conv.clone()
    out[:, :, -1] += right[:, :, 0].to(conv.dtype)
    return out


def _groups(config: CloverConfig) -> dict[str, tuple[str, tuple[str, ...], Callable[..., torch.Tensor]]]:
    """Clover tensors (by name suffix) that become one vLLM tensor: suffix -> (the vLLM tensor's suffix, the
    Clover suffixes it is made of, in argument order, how)."""
    hk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    qkvz = (_LA + "in_proj_qkvz.weight", (_LA + "in_proj_qkv.weight", _LA + "in_proj_z.weight"),
            lambda qkv, z: join_qkvz(qkv, z, hk, dk))
    ba = (_LA + "in_proj_ba.weight", (_LA + "in_proj_b.weight", _LA + "in_proj_a.weight"),
          lambda b, a: join_ba(b, a, hk))
    groups = {part: group for group in (qkvz, ba) for part in group[1]}
    if config.deltanet_reading != "causal":
        conv = (_LA + "conv1d.weight", (_LA + "conv1d.weight", _LA + "conv1d_right.weight"), _fold_right_conv)
        groups.update({part: conv for part in conv[1]})
    return groups


def causal_path_tensors(tensors: Iterable[tuple[str, torch.Tensor]],
                        config: CloverConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Map a stream of `(Clover name, tensor)` to `(vLLM name, tensor)` (see the module docstring), streaming:
    only the parts of one fused tensor wait for each other."""
    groups = _groups(config) if config.has_linear_attention else {}
    dropped = ADAPTER_SUFFIXES + (_LA + "memory_calibration",)
    if config.deltanet_reading == "causal":
        dropped += (_LA + "conv1d_right.weight",)
    pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # (layer prefix, vLLM suffix) -> parts seen
    for name, tensor in tensors:
        if name.endswith(dropped):
            continue
        part = next((s for s in groups if name.endswith(s)), None)
        if part is not None:
            out, parts, combine = groups[part]
            prefix = name.removesuffix(part)
            seen = pending.setdefault((prefix, out), {})
            seen[part] = tensor
            if len(seen) == len(parts):
                del pending[(prefix, out)]
                yield prefix + out, combine(*(seen[p] for p in parts))
        elif name.endswith(".mlp.experts.gate_up_proj"):
            prefix, inner = name.removesuffix("gate_up_proj"), tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", tensor[e, :inner]
                yield f"{prefix}{e}.up_proj.weight", tensor[e, inner:]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(tensor.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor
    if pending:
        raise ValueError("incomplete Clover checkpoint: " + "; ".join(
            f"{prefix}{out} lacks {sorted(set(groups[next(iter(seen))][1]) - set(seen))}"
            for (prefix, out), seen in pending.items()))
