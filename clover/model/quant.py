"""Weight-only quantisation of a loaded model, and the fused projections of the fast CPU forward.

`quantize(model, "int4")` replaces every linear layer and the LM head by a `PackedLinear` (clover.ops.woq:
int8 or int4 with a scale per group of 32 inputs, or fp32 / bf16 weights left unquantised: the same kernel, flat
in rows, for an unquantised model); embeddings and norms keep their dtype, activations stay in the model's dtype. On the way it fuses the projections that read the same
input: q/k/v of an attention layer into one `qkv_proj`, gate/up of a dense MLP into one `gate_up_proj`, so a
layer makes three weight-streaming calls instead of seven, from the same checkpoint's tensors.

Adapters: a model with an unmerged adapter is refused (merge it first, `clover.model.lora.merge_and_unload`);
a gated adapter, which acts at query positions only, cannot be merged, so such a model runs unquantised.

A quantised model saves as usual (`save_pretrained`): its packed tensors in `model.safetensors` and the format
in `quantization.json`, from which `from_pretrained` rebuilds the same modules before loading.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from clover.ops import woq

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("none", "fp32", "bf16", "int8", "int4")  # fp32 / bf16: unquantised weights, through the kernel
QUANT_CONFIG = "quantization.json"


class PackedLinear(nn.Module):
    """A bias-free linear layer over packed weights (`clover.ops.woq`): the kernel on CPU, a dequantised matmul
    elsewhere. Input and output keep the caller's dtype; the kernel accumulates in fp32."""

    def __init__(self, in_features: int, out_features: int, kind: str, group_size: int = woq.DEFAULT_GROUP_SIZE,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        woq.check(kind, in_features, group_size)
        self.in_features, self.out_features, self.kind, self.group_size = in_features, out_features, kind, group_size
        shapes = woq.pack(torch.zeros(out_features, in_features, device="meta"), kind, group_size)
        for name, t in shapes.items():
            self.register_buffer(name, torch.empty(t.shape, dtype=t.dtype, device=device))

    @classmethod
    def from_weight(cls, weight: torch.Tensor, kind: str, group_size: int = woq.DEFAULT_GROUP_SIZE,
                    name: str = "weight") -> "PackedLinear":
        out_features, in_features = weight.shape
        woq.check(kind, in_features, group_size, name)
        layer = cls(in_features, out_features, kind, group_size, device="meta")
        for key, t in woq.pack(weight, kind, group_size, name).items():
            setattr(layer, key, t.to(weight.device))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = (self.qweight, self.scale, self.zero, self.kind, self.out_features, self.group_size)
        y = woq.woq_linear(x, *args) if x.device.type == "cpu" else woq.reference_linear(x, *args)
        return y.to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        """The fp32 `[out, in]` weights this layer computes with."""
        return woq.unpack(self.qweight, self.scale, self.zero, self.kind, self.out_features, self.in_features,
                          self.group_size)

    def weight_bytes(self) -> int:
        """Bytes the layer reads per forward (packed weights, scales, minima)."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale, self.zero))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}" + \
            (f", group_size={self.group_size}" if self.kind == "int4" else "")


def check_quantization(quant: str) -> None:
    if quant not in QUANTIZATIONS:
        raise ValueError(f"unknown quantisation {quant!r}: expected one of {list(QUANTIZATIONS)}")


def quantize(model: nn.Module, quant: str = "int4", group_size: int = woq.DEFAULT_GROUP_SIZE) -> nn.Module:
    """Pack (and quantise) `model`'s linear layers and LM head in place; returns the model. `"none"`: unchanged."""
    check_quantization(quant)
    if quant == "none":
        return model
    _check_plain(model)
    _convert(model, quant, group_size, meta=False)
    model.quantization = {"quant": quant, "group_size": group_size, "layout": woq.LAYOUT_VERSION}
    logger.info("quantised to %s: %.1f MB of linear weights", quant, packed_bytes(model) / 1e6)
    return model


def packed_bytes(model: nn.Module) -> int:
    return sum(m.weight_bytes() for m in model.modules() if isinstance(m, PackedLinear))


def save_quantization(model: nn.Module, directory: Path) -> None:
    (Path(directory) / QUANT_CONFIG).write_text(json.dumps(model.quantization, indent=2) + "\n")


def prepare_quantized(model: nn.Module, directory: Path) -> None:
    """Give a model built on the meta device the packed modules a quantised checkpoint in `directory` stores."""
    spec = json.loads((Path(directory) / QUANT_CONFIG).read_text())
    quant, group_size = spec.get("quant"), spec.get("group_size", woq.DEFAULT_GROUP_SIZE)
    check_quantization(quant)
    layout = spec.get("layout", 1)  # checkpoints from before the layout was versioned are layout 1
    if layout != woq.LAYOUT_VERSION:
        raise ValueError(f"{directory} holds {quant} weights packed in layout {layout}, but this version of clover "
                         f"reads layout {woq.LAYOUT_VERSION}: quantise the unquantised checkpoint again "
                         f"(clover.quantize, or --quant {quant})")
    _convert(model, quant, group_size, meta=True)
    model.quantization = {"quant": quant, "group_size": group_size, "layout": layout}


def _check_plain(model: nn.Module) -> None:
    from clover.model.lora import has_lora, is_gated

    if is_gated(model):
        raise ValueError("a model with a gated adapter (query positions only) cannot be quantised: the adapter "
                         "cannot be merged into the weights; run it unquantised")
    if has_lora(model):
        raise ValueError("merge the adapter before quantising (clover.model.lora.merge_and_unload)")
    if getattr(model, "quantization", None):
        raise ValueError(f"the model is already quantised ({model.quantization['quant']})")


def _convert(model: nn.Module, kind: str, group_size: int, meta: bool) -> None:
    """Fuse and pack: from the weights, or (`meta`) empty modules of the right shapes for a checkpoint to fill."""
    from clover.model.attention import Attention
    from clover.model.moe import SwiGLU

    def packed(weights: list[torch.Tensor], name: str) -> PackedLinear:
        out_features = sum(w.shape[0] for w in weights)
        if meta:
            return PackedLinear(weights[0].shape[1], out_features, kind, group_size, device="meta")
        return PackedLinear.from_weight(torch.cat(weights) if len(weights) > 1 else weights[0], kind, group_size,
                                        name)

    def plain(*layers: nn.Module) -> bool:
        return all(type(m) is nn.Linear and m.bias is None for m in layers)

    for name, module in list(model.named_modules()):
        if isinstance(module, Attention) and plain(module.q_proj, module.k_proj, module.v_proj):
            parts = [module.q_proj, module.k_proj, module.v_proj]
            module.qkv_proj = packed([p.weight for p in parts], f"{name}.qkv_proj")
            module.qkv_sizes = [p.out_features for p in parts]
            del module.q_proj, module.k_proj, module.v_proj
        elif isinstance(module, SwiGLU) and plain(module.gate_proj, module.up_proj):
            module.gate_up_proj = packed([module.gate_proj.weight, module.up_proj.weight], f"{name}.gate_up_proj")
            del module.gate_proj, module.up_proj
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear:
            if module.bias is not None:
                raise ValueError(f"cannot quantise {name}: linear layers with a bias are not supported")
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, packed([module.weight], name))

