"""The fused CPU decoder layer: a whole Llama-form layer over packed weights in one C++ call.

A decoding step of a small model on a CPU is bound by dispatch, not arithmetic: clover-smol's one-token step
runs dozens of eager ops per layer at microseconds each, more time than its int4 weights take to stream. A layer whose
projections are all `PackedLinear` (clover.model.quant), with plain softmax attention (no q/k norm, no output
gate), RMSNorm and a dense SwiGLU, runs instead as `clover/ops/csrc/layer.cpp`: the same packed kernels, the
norms, RoPE, the attention of a block step and SiLU as loops, keys and values written straight into the cache.

`quantize` marks such layers (`DecoderLayer.fused`, `clover.model.quant.can_fuse`); they take this path for fp32
activations on a CPU without autograd, and the module path otherwise, which stays the reference
(tests/model/test_fused_layer.py). When every layer of a model is marked (and none has a hook) the model runs the
whole stack in one call (`fused_layers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from clover.model.layout import BlockLayout
from clover.model.prompt_rows import is_reading_prompt, prompt_matmul
from clover.ops import woq


class LayerContext(Protocol):
    """What the fused path reads of one forward's context (built by clover.model.modeling's forward)."""

    layout: BlockLayout
    rope: tuple[torch.Tensor, torch.Tensor]
    mask: torch.Tensor | None
    is_causal: bool
    gate: Any  # a gated adapter's `AdapterGate` (clover.model.lora), or None


def runs_fused(h: torch.Tensor, ctx: LayerContext) -> bool:
    """Whether a forward's marked layers take the fused path: fp32 on a CPU, nothing for autograd to record, and
    either prompt rows the integer kernel multiplies (however many: a prompt token's bits must not depend on the
    rows beside it, `reading_prompt`, and the fused layer computes other bits than the modules) or fewer decoding
    rows than `woq.DENSE_ROWS` (the fused layer's gain is dispatch, which many rows amortise)."""
    if h.dtype != torch.float32 or h.device.type != "cpu" or (h.requires_grad and torch.is_grad_enabled()):
        return False
    if is_reading_prompt():
        return prompt_matmul() == "kernel"
    return h.shape[0] * h.shape[1] < woq.DENSE_ROWS


def layer_weights(layer: nn.Module) -> tuple:
    """The layer's weights as the C++ layer takes them: `(norm1, norm2, eps, qkv, o, gate_up, down)`, each
    projection its `PackedLinear.kernel_args()`."""
    # submodules and parameters from the modules' dicts: `nn.Module.__getattr__` is slow for a hot path, and
    # this runs once per layer and forward
    modules = layer._modules
    attn, mlp = modules["self_attn"]._modules, modules["mlp"]._modules
    norm1, norm2 = modules["input_layernorm"], modules["post_attention_layernorm"]
    try:
        return (norm1._parameters["weight"], norm2._parameters["weight"], norm1.eps,
                attn["qkv_proj"].kernel_args(), attn["o_proj"].kernel_args(), mlp["gate_up_proj"].kernel_args(),
                mlp["down_proj"].kernel_args())
    except (KeyError, AttributeError) as error:  # `fused` is set once, by `quantize`
        raise RuntimeError("a decoder layer marked for the fused C++ path no longer has packed projections (its "
                           "modules were replaced after quantising): set `layer.fused = "
                           "clover.model.quant.can_fuse(layer)` after changing a quantised layer") from error


def fused_layers(layers: Sequence[nn.Module], h: torch.Tensor, ctx: LayerContext,
                 caches: Sequence[Any] | None) -> torch.Tensor:
    """`layer(h)` of each layer in turn by the C++ layer, in one call; each layer's first `clean_len` keys/values
    are committed to its cache (`caches[i]`, or none) as `Attention.forward` does (the rest are written past its
    length, where the next append overwrites them)."""
    n, t, _ = h.shape
    attn = layers[0]._modules["self_attn"]
    heads, kv_heads, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if caches is None:
        past = 0
        buffers = [(h.new_empty(n, kv_heads, t, d), h.new_empty(n, kv_heads, t, d)) for _ in layers]
    else:
        past = caches[0].length
        if any(cache.length != past for cache in caches):  # one `past` for the whole stack
            raise RuntimeError(f"the layers' caches hold different lengths {sorted({c.length for c in caches})}: "
                               "a forward appends at one position in every layer")
        buffers = [cache.reserve(t, n, kv_heads, d, d, h) for cache in caches]
    # a gated adapter's corrections act at the query stream only: from the clean tokens' end of each row on
    gated_from = ctx.layout.clean_len if ctx.gate is not None else 0
    out = woq.extension().decoder_layers(
        h.contiguous(), [layer_weights(layer) for layer in layers], *ctx.rope, [k for k, _ in buffers],
        [v for _, v in buffers], past, ctx.mask, ctx.is_causal, heads, kv_heads, d, woq.TILE_K, True, gated_from)
    if caches is not None:
        for cache in caches:
            cache.length += ctx.layout.clean_len
    return out
