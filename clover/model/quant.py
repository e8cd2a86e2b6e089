"""Weight-only quantisation of a loaded model, and the fused projections of the fast CPU forward.

(Over the ~450-line mark on purpose: one format, its packing, fusing, adapter corrections, saving and loading,
which must agree with each other; its kernels are clover.ops.woq, the layers run in C++ clover.model.fused.)

`quantize(model, "int4")` replaces every linear layer and the LM head by a `PackedLinear` (clover.ops.woq:
int8 or int4 with a scale per group of 32 inputs, or fp32 / bf16 weights left unquantised: the same weight
streaming for an unquantised model); embeddings and norms keep their dtype, activations stay in the model's dtype
between layers. On the way it fuses the projections that read the same input: q/k/v of an attention layer into
one `qkv_proj`, gate/up of a dense MLP into one `gate_up_proj`, so a layer makes three weight-streaming calls
instead of seven, from the same checkpoint's tensors.

The LM head of an `int4` model is `int8` by default (llama.cpp, too, keeps its output tensor at higher precision:
the logits read it directly); `quantize(..., head=)` chooses otherwise.

On the CPU, int8 / int4 layers round their input to int8 per group for integer dot products (clover.ops.woq):
`activations="int8x2"` rounds it in two passes, the second re-rounding the first one's residual (an error ~254x
smaller, for up to twice the integer work), `"int8"` in one (llama.cpp's way). By default (`default_activations`)
int8 weights get two passes and int4 one: rounding to int4 costs far more than the activations' one pass, which
a second would not buy back; where the int4 weights are exact (clover-smol's int4 build, clover.smol), two
passes are what keeps the model's outputs. It changes no weight: `quantize(model, quant, activations=...)` on a
model quantised in that format already switches it.

Adapters: an unmerged LoRA adapter is kept beside the quantised *base* weights as a low-rank correction,
`y = W_q x + (x A^T) B'` with A and B' in fp16 (accumulated in fp32), rather than merged and rounded: a base that
comes from a quantised file (clover-smol's Q4_1 GGUF) is rounded back onto its own codes exactly, so the quantised
model computes what the unquantised adapted model computes up to the adapter's fp16 rounding (`woq.pack_correction`)
and the CPU kernel's rounding of the activations (clover.ops.woq). Fused
projections (q/k/v, gate/up) concatenate their A's and place their `scaling * B^T` block-diagonally in `B'`; the
kernel adds the correction in the same C++ call, reading the non-zero rows of B' with the weights. The
embedding's trained rows (`row_delta`) are merged into the table, as `merge_and_unload` does. A gated adapter
(query positions only) keeps its corrections gated: the kernel adds them only at the rows of the query stream
(`AdapterGate.grid`, woq.cpp's `corr_from`), so the clean stream is the quantised base itself; its `[MASK]` row
is merged (`_ungate_mask_rows` says why that is exact).

A quantised model saves as usual (`save_pretrained`): its packed tensors (and corrections) in `model.safetensors`
and the format in `quantization.json` (`quant`, `group_size`, `lm_head`, `activations`, the packed `layout`'s
version, `low_rank`: each corrected layer's rank, and `gated`), from which `from_pretrained` rebuilds the same modules
before loading (a file without `activations`, from before the choice existed, gets the one-pass `"int8"`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from clover.choices import QUANTIZATIONS
from clover.model.attention import Attention
from clover.model.deltanet import GatedDeltaNet
from clover.model.lora import AdapterGate, LoRALinear, TrainableRowsEmbedding, has_lora, merge_and_unload
from clover.model.moe import Experts, SparseMoE, SwiGLU, run_experts
from clover.model.prompt_rows import is_reading_prompt, prompt_matmul
from clover.ops import woq

logger = logging.getLogger(__name__)

QUANT_CONFIG = "quantization.json"


class PackedLinear(nn.Module):
    """A bias-free linear layer over packed weights (`clover.ops.woq`): the kernel on CPU, a dequantised matmul
    elsewhere; optionally plus a rank-`rank` correction `(x A^T) B'` (`correction_a` `[rank, in]`,
    `correction_b` `[rank, out]`, fp16 stored as int16 bits like the packed scales, so a model-wide
    `.to(dtype)` never rounds them: `woq.pack_correction`). Input and output keep the caller's dtype; the kernel
    accumulates in fp32.
    `activations`: how the kernel rounds the input of an int8 / int4 layer (`woq.ACTIVATIONS`)."""

    def __init__(self, in_features: int, out_features: int, kind: str, group_size: int = woq.DEFAULT_GROUP_SIZE,
                 rank: int = 0, device: torch.device | str | None = None, activations: str = "int8") -> None:
        super().__init__()
        woq.check(kind, in_features, group_size)
        woq.check_activations(activations)
        self.in_features, self.out_features, self.kind, self.group_size = in_features, out_features, kind, group_size
        self.rank, self.activations = rank, activations
        for name, (shape, dtype) in woq.packed_shapes(out_features, in_features, kind, group_size).items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))
        if rank:
            self.register_buffer("correction_a", torch.empty(rank, in_features, dtype=torch.int16, device=device))
            self.register_buffer("correction_b", torch.empty(rank, out_features, dtype=torch.int16, device=device))
            # B' as the kernel reads it (woq.tile_correction): derived, so not saved, and made again on loading
            self.register_buffer("correction_tiles", None, persistent=False)
            self.register_buffer("correction_index", None, persistent=False)
            self.register_load_state_dict_post_hook(lambda module, _: module.tile_correction())
        self.gate: Any = None  # a gated adapter's `AdapterGate` (clover.model.lora): the correction at query rows only

    @classmethod
    def from_weight(cls, weight: torch.Tensor, kind: str, group_size: int = woq.DEFAULT_GROUP_SIZE,
                    name: str = "weight", correction: tuple[torch.Tensor, torch.Tensor] | None = None,
                    activations: str = "int8") -> PackedLinear:
        """Pack `weight` `[out, in]`; `correction`: `(A [r, in], B' [r, out])`, added as `(x A^T) B'`."""
        out_features, in_features = weight.shape
        woq.check(kind, in_features, group_size, name)
        rank = 0 if correction is None else correction[0].shape[0]
        if correction is not None and (correction[0].shape != (rank, in_features)
                                       or correction[1].shape != (rank, out_features)):
            raise ValueError(f"{name}: a low-rank correction of {list(weight.shape)} weights needs A [r, "
                             f"{in_features}] and B' [r, {out_features}], got {list(correction[0].shape)} and "
                             f"{list(correction[1].shape)}")
        layer = cls(in_features, out_features, kind, group_size, rank, device="meta", activations=activations)
        for key, t in woq.pack(weight, kind, group_size, name).items():
            setattr(layer, key, t.to(weight.device))
        if correction is not None:
            layer.correction_a, layer.correction_b = (
                t.to(weight.device) for t in woq.pack_correction(*correction, name=name))
            layer.tile_correction()
        return layer

    def tile_correction(self) -> None:
        """Lay B' out for the kernel (`correction_tiles`, `correction_index`: woq.tile_correction)."""
        self.correction_tiles, self.correction_index = woq.tile_correction(self.correction_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = (x, self.qweight, self.scale, self.zero, self.kind, self.out_features, self.group_size,
                (self.correction_a, self.correction_b) if self.rank else None)
        gate = self.gate.grid() if self.gate is not None and self.rank else None
        if x.device.type != "cpu":
            return woq.reference_linear(*args, gate=gate)  # elsewhere: the dequantised matmul, x not rounded
        if self.activations == "int8x2" and is_reading_prompt() and prompt_matmul() == "fp32":
            # prompt rows: the weights decoded once, then torch's fp32 matmul, x not rounded (`prompt_matmul`)
            weight = woq.dequantize(self.qweight, self.scale, self.zero, self.kind, self.out_features,
                                    self.in_features, self.group_size)
            return woq.reference_linear(*args, gate=gate, weight=weight)
        return woq.woq_linear(*args, correction_tiles=(self.correction_tiles, self.correction_index)
                              if self.rank else None, activations=self.activations, gate=gate)

    def kernel_args(self) -> tuple:
        """The layer as the C++ decoder layer takes it (clover.model.fused): `(qweight, scale, zero, kind code,
        out_features, group_size, A, B' tiles, their index, activation passes)`, A, the tiles and the index None
        without a correction. Read from `_buffers` directly: `nn.Module.__getattr__` is slow for a hot path, and a
        step makes 120 of these calls."""
        b = self._buffers
        return (b["qweight"], b["scale"], b["zero"], woq.KINDS[self.kind], self.out_features, self.group_size,
                b.get("correction_a"), b.get("correction_tiles"), b.get("correction_index"),
                woq.ACTIVATIONS[self.activations])

    def expert_args(self) -> tuple:
        """The layer as `woq.moe` takes a shared expert's projection: one expert's stack (E = 1)."""
        b = self._buffers
        return (b["qweight"][None], b["scale"][None], b["zero"][None], woq.KINDS[self.kind], self.out_features,
                self.group_size)

    def dequantized(self) -> torch.Tensor:
        """The fp32 `[out, in]` weights this layer computes with (the correction, if any, not included)."""
        return woq.unpack(self.qweight, self.scale, self.zero, self.kind, self.out_features, self.in_features,
                          self.group_size)

    def weight_bytes(self) -> int:
        """Bytes the layer reads per forward: packed weights, scales, minima, and the correction's A and the
        tiles of B' (its rows that are not zero, per block of 16 outputs)."""
        tensors = [self.qweight, self.scale, self.zero]
        if self.rank:
            tensors += [self.correction_a, self.correction_tiles]
        return sum(t.numel() * t.element_size() for t in tensors)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}" + \
            (f", group_size={self.group_size}" if self.kind == "int4" else "") + \
            (f", activations={self.activations}" if self.kind in ("int8", "int4") else "") + \
            (f", rank={self.rank}" if self.rank else "")


class PackedExperts(nn.Module):
    """A MoE's routed experts packed like `PackedLinear`'s weights, every expert's projection stacked
    (`woq.pack_experts`): `gate_up_*` `[E, ...]` of `[2I, H]` (gate rows, then up), `down_*` of `[H, I]`. On a CPU
    in fp32, without autograd, the whole layer (router, the chosen experts grouped by expert, the shared expert
    and its gate) is one C++ call (`grouped`, `woq.moe`); elsewhere the dequantised experts run as
    `clover.model.moe.Experts` runs its own (the reference)."""

    PROJECTIONS = ("gate_up", "down")

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, kind: str,
                 group_size: int = woq.DEFAULT_GROUP_SIZE, device: torch.device | str | None = None,
                 activations: str = "int8") -> None:
        super().__init__()
        woq.check_activations(activations)
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.kind, self.group_size, self.activations = kind, group_size, activations
        for proj, (out_features, in_features) in self._shapes().items():
            for name, (shape, dtype) in woq.packed_shapes(out_features, in_features, kind, group_size).items():
                self.register_buffer(f"{proj}_{name}", torch.empty(num_experts, *shape, dtype=dtype, device=device))

    def _shapes(self) -> dict[str, tuple[int, int]]:
        return {"gate_up": (2 * self.intermediate_size, self.hidden_size),
                "down": (self.hidden_size, self.intermediate_size)}

    @classmethod
    def from_experts(cls, experts: Experts, kind: str, group_size: int = woq.DEFAULT_GROUP_SIZE, name: str = "experts",
                     activations: str = "int8") -> PackedExperts:
        e, two_i, h = experts.gate_up_proj.shape
        layer = cls(e, h, two_i // 2, kind, group_size, device="meta", activations=activations)
        for proj, weight in (("gate_up", experts.gate_up_proj), ("down", experts.down_proj)):
            for key, t in woq.pack_experts(weight, kind, group_size, f"{name}.{proj}_proj").items():
                setattr(layer, f"{proj}_{key}", t.to(weight.device))
        return layer

    def args(self, proj: str) -> tuple:
        """One projection as `woq.moe` takes it: `(qweight, scale, zero, kind code, out_features, group_size)`."""
        b = self._buffers
        return (b[f"{proj}_qweight"], b[f"{proj}_scale"], b[f"{proj}_zero"], woq.KINDS[self.kind],
                self._shapes()[proj][0], self.group_size)

    def dequantized(self, proj: str) -> torch.Tensor:
        """The fp32 `[E, out, in]` weights of `proj` ("gate_up" or "down")."""
        out_features, in_features = self._shapes()[proj]
        b = self._buffers
        return woq.unpack_experts(b[f"{proj}_qweight"], b[f"{proj}_scale"], b[f"{proj}_zero"], self.kind,
                                  out_features, in_features, self.group_size)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The module path: the dequantised experts, x not rounded."""
        return run_experts(x, weights, experts, self.dequantized("gate_up").to(x), self.dequantized("down").to(x))

    def grouped(self, moe: SparseMoE, x: torch.Tensor) -> torch.Tensor | None:
        """`moe(x)` for `x [T, H]` in one C++ call, or None where the module path runs: off the CPU, another dtype
        than fp32, autograd recording, prompt rows that `prompt_matmul` multiplies in fp32 (as `PackedLinear`
        does), or a shared expert not in the experts' packed format (an adapter on it)."""
        if x.device.type != "cpu" or x.dtype != torch.float32 or (x.requires_grad and torch.is_grad_enabled()):
            return None
        if self.activations == "int8x2" and is_reading_prompt() and prompt_matmul() == "fp32":
            return None
        shared = None
        if moe.shared_expert is not None:
            mlp, gate = moe.shared_expert._modules, moe.shared_expert_gate
            parts = (mlp.get("gate_up_proj"), mlp.get("down_proj"))
            if type(gate) is not nn.Linear or not all(
                    isinstance(p, PackedLinear) and not p.rank and p.kind == self.kind
                    and p.group_size == self.group_size for p in parts):
                return None
            shared = (parts[0].expert_args(), parts[1].expert_args(), gate.weight.detach().view(-1))
        router = moe.gate
        return woq.moe(x.contiguous(), router.weight.detach(), router.top_k, router.normalize, self.args("gate_up"),
                       self.args("down"), shared, self.activations)

    def weight_bytes(self) -> int:
        """Bytes of every expert's packed weights, scales and minima (a token reads top-k / E of them)."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, " \
               f"intermediate_size={self.intermediate_size}, kind={self.kind}, activations={self.activations}"


def check_quantization(quant: str) -> None:
    if quant not in QUANTIZATIONS:
        raise ValueError(f"unknown quantisation {quant!r}: expected one of {list(QUANTIZATIONS)}")


def default_activations(quant: str) -> str:
    """How `quant`'s layers round their input by default: two int8 passes for int8 weights, one for int4 (on
    clover-smol, round-to-nearest int8: top-1 agreement 96.2 -> 97.5 %, KL 5.7e-3 -> 1.7e-3 with two; int4:
    74.5 -> 75.7 %, the weights' error dominating, for ~30 % more time per 4-row step: docs/cpu.md,
    `benchmarks/results/bench_quant_agreement_activations.json`)."""
    return "int8x2" if quant == "int8" else "int8"


def default_head(quant: str) -> str:
    """The LM head's format for `quant`: int8 under int4 (the logits read the head directly; clover-smol's head
    is a Q8_0 table, which int8 holds exactly), else `quant` itself."""
    return "int8" if quant == "int4" else quant


def quantize(model: nn.Module, quant: str = "int4", group_size: int = woq.DEFAULT_GROUP_SIZE,
             head: str | None = None, activations: str | None = None) -> nn.Module:
    """Pack (and quantise) `model`'s linear layers and LM head in place; returns the model. `"none"`, or a model
    loaded quantised in that format already: unchanged (but for `activations`, set if given). `head`: the LM
    head's format (default `default_head(quant)`). `activations`: how int8 / int4 layers round their input on the
    CPU (`woq.ACTIVATIONS`, default `default_activations(quant)`). An unmerged adapter is kept as a low-rank
    correction beside the quantised base weights, a gated one applied at query rows only (module docstring)."""
    check_quantization(quant)
    if activations is not None:
        woq.check_activations(activations)
    current = getattr(model, "quantization", None) or {}
    if quant == "none" or (current.get("quant") == quant and head in (None, current.get("lm_head", quant))):
        if activations is not None and current:  # a property of the computation, not of the packed weights
            for module in model.modules():
                if isinstance(module, (PackedLinear, PackedExperts)):
                    module.activations = activations
            current["activations"] = activations
        return model
    head = head or default_head(quant)
    activations = activations or default_activations(quant)
    if head not in woq.KINDS:
        raise ValueError(f"unknown LM head format {head!r}: expected one of {list(woq.KINDS)}")
    _check_quantizable(model)
    adapted = has_lora(model)
    gate, model.adapter_gate = getattr(model, "adapter_gate", None), None
    for module in model.modules():  # trained rows into the table first: a tied head is packed from it
        if isinstance(module, TrainableRowsEmbedding):
            if module.gate is not None:
                _ungate_mask_rows(module, model.config.mask_token_id)
            module.merge()
    ranks = _convert(model, quant, group_size, head, activations)
    if adapted:
        merge_and_unload(model)  # what is left of the adapter: the merged embedding, back to a plain module
    model.quantization = {"quant": quant, "group_size": group_size, "lm_head": head, "activations": activations,
                          "layout": woq.LAYOUT_VERSION}
    if gate is not None:
        _gate_corrections(model, gate)
    if ranks:
        model.quantization["low_rank"] = ranks
    logger.info("quantised to %s (LM head %s, %s activations%s): %.1f MB of linear weights", quant, head, activations,
                f", {len(ranks)} layers with a low-rank correction" if ranks else "", packed_bytes(model) / 1e6)
    return model


def packed_bytes(model: nn.Module) -> int:
    return sum(m.weight_bytes() for m in model.modules() if isinstance(m, (PackedLinear, PackedExperts)))


def save_quantization(model: nn.Module, directory: Path) -> None:
    (Path(directory) / QUANT_CONFIG).write_text(json.dumps(model.quantization, indent=2) + "\n")


def prepare_quantized(model: nn.Module, directory: Path) -> None:
    """Give a model built on the meta device the packed modules a quantised checkpoint in `directory` stores."""
    path = Path(directory) / QUANT_CONFIG
    spec = json.loads(path.read_text())
    quant = spec.get("quant")
    check_quantization(quant)
    layout = spec.get("layout", 1)  # checkpoints from before the layout was versioned are layout 1
    if layout != woq.LAYOUT_VERSION:
        raise ValueError(f"{directory} holds {quant} weights packed in layout {layout}, but this version of clover "
                         f"reads layout {woq.LAYOUT_VERSION}: quantise the unquantised checkpoint again "
                         f"(clover.quantize, or --quant {quant})")
    group_size = spec.get("group_size", woq.DEFAULT_GROUP_SIZE)
    head = spec.get("lm_head")
    if head not in woq.KINDS:
        raise ValueError(f"{path}: unknown lm_head format {head!r}: expected one of {list(woq.KINDS)}")
    activations = spec.get("activations", "int8")  # files from before the choice: the one-pass rounding they had
    if activations not in woq.ACTIVATIONS:
        raise ValueError(f"{path}: unknown activation rounding {activations!r}: expected one of "
                         f"{list(woq.ACTIVATIONS)}")
    ranks = spec.get("low_rank", {})
    _convert(model, quant, group_size, head, activations, ranks=ranks)
    unknown = sorted(set(ranks) - {n for n, m in model.named_modules() if isinstance(m, PackedLinear)})
    if unknown:
        raise ValueError(f"{path}: low_rank names layers the model does not have: {unknown[:4]}")
    model.quantization = {**spec, "activations": activations}
    if spec.get("gated"):
        _gate_corrections(model, AdapterGate())


def _gate_corrections(model: nn.Module, gate: Any) -> None:
    """A gated adapter's corrections act at the query stream only: every corrected layer reads the model's gate,
    which its forward places (clover.model.lora.AdapterGate)."""
    model.adapter_gate = gate
    for module in model.modules():
        if isinstance(module, PackedLinear) and module.rank:
            module.gate = gate
    model.quantization["gated"] = True


def _ungate_mask_rows(embedding: nn.Module, mask_token_id: int | None) -> None:
    """A gated adapter's trained embedding rows act at query positions only. Merged into the table they act
    wherever their ids occur: the same only for the `[MASK]` row, whose id the clean stream never attends to
    (it appears there only as padding, masked out) and never emits (its logit is banned, so the tied head's
    row changing with it changes no choice). Any other gated row is refused."""
    others = sorted(set(embedding.rows.tolist()) - {mask_token_id})
    if others:
        raise ValueError(f"a gated adapter's trained embedding rows {others[:4]} act at query positions only and "
                         "cannot be merged into a quantised table (only the [MASK] row can): run it unquantised")
    embedding.gate = None


def _check_quantizable(model: nn.Module) -> None:
    if getattr(model, "quantization", None):
        raise ValueError(f"the model is already quantised ({model.quantization['quant']})")


def _low_rank(layers: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The unmerged adapters of `layers` (fused along their outputs) as one correction `(A, B')`: the A's
    concatenated, `[sum r_i, in]`, and `B' [sum r_i, sum out_i]` holding `scaling_i * B_i^T` block-diagonally,
    so `(x A^T) B'` is the concatenation of each layer's `scaling_i * (x A_i^T) B_i^T`."""
    adapted = [m for m in layers if isinstance(m, LoRALinear) and not m.merged]
    if not adapted:
        return None
    a = torch.cat([m.lora_A.detach().float() for m in adapted])
    b = a.new_zeros(a.shape[0], sum(m.out_features for m in layers))
    row = col = 0
    for m in layers:
        if m in adapted:
            b[row : row + m.rank, col : col + m.out_features] = m.lora_B.detach().float().T * m.scaling
            row += m.rank
        col += m.out_features
    return a, b


def can_fuse(layer: nn.Module) -> bool:
    """Whether the decoder layer `layer` has the structure the fused C++ layer computes (clover.model.fused)."""
    attn, mlp = getattr(layer, "self_attn", None), layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (isinstance(attn, Attention) and isinstance(attn.qkv_proj, PackedLinear)
            and isinstance(attn.o_proj, PackedLinear) and attn.q_norm is None and not attn.output_gate
            and isinstance(mlp, SwiGLU) and isinstance(mlp.gate_up_proj, PackedLinear)
            and isinstance(mlp.down_proj, PackedLinear) and not any(norm.zero_centered for norm in norms))


def _convert(model: nn.Module, kind: str, group_size: int, head: str, activations: str,
             ranks: dict[str, int] | None = None) -> dict[str, int]:
    """Fuse and pack: from the weights (and adapters), or, given the stored layers' correction `ranks`, empty
    modules on the meta device of the right shapes for a checkpoint to fill. Returns the corrected layers' ranks."""
    meta = ranks is not None
    corrected: dict[str, int] = {}
    lm_head = getattr(model, "lm_head", None)

    def packed(layers: list[nn.Linear], name: str) -> PackedLinear:
        layer_kind = head if layers[0] is lm_head else kind
        out_features, in_features = sum(m.out_features for m in layers), layers[0].in_features
        if meta:
            return PackedLinear(in_features, out_features, layer_kind, group_size, ranks.get(name, 0), device="meta",
                                activations=activations)
        weight = torch.cat([m.weight for m in layers]) if len(layers) > 1 else layers[0].weight
        layer = PackedLinear.from_weight(weight, layer_kind, group_size, name, _low_rank(layers), activations)
        if layer.rank:
            corrected[name] = layer.rank
        return layer

    def linear(module: nn.Module) -> bool:
        return type(module) in (nn.Linear, LoRALinear)

    def plain(*layers: nn.Module) -> bool:
        return all(linear(m) and m.bias is None for m in layers)

    for name, module in list(model.named_modules()):
        if isinstance(module, Attention) and plain(module.q_proj, module.k_proj, module.v_proj):
            parts = [module.q_proj, module.k_proj, module.v_proj]
            module.qkv_proj = packed(parts, f"{name}.qkv_proj")
            module.qkv_sizes = [p.out_features for p in parts]
            del module.q_proj, module.k_proj, module.v_proj
        elif isinstance(module, SwiGLU) and plain(module.gate_proj, module.up_proj):
            module.gate_up_proj = packed([module.gate_proj, module.up_proj], f"{name}.gate_up_proj")
            del module.gate_proj, module.up_proj
        elif isinstance(module, SparseMoE) and isinstance(module.experts, Experts):
            experts = module.experts
            if meta:
                e, two_i, h = experts.gate_up_proj.shape
                module.experts = PackedExperts(e, h, two_i // 2, kind, group_size, device="meta",
                                               activations=activations)
            else:
                module.experts = PackedExperts.from_experts(experts, kind, group_size, f"{name}.experts", activations)
    # a shared expert's gate [1, H] keeps its weights, as the router does: a dot product per token, read in fp32 by
    # the grouped MoE call (one with an adapter is packed with its correction)
    kept = {f"{name}.shared_expert_gate" for name, module in model.named_modules()
            if isinstance(module, SparseMoE) and type(module.shared_expert_gate) is nn.Linear
            and f"{name}.shared_expert_gate" not in (ranks or {})}
    for name, module in list(model.named_modules()):
        if linear(module) and name not in kept:
            if module.bias is not None:
                raise ValueError(f"cannot quantise {name}: linear layers with a bias are not supported")
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, packed([module], name))
    for module in model.modules():
        if hasattr(module, "fused"):  # a decoder layer (clover.model.modeling): its flag for the C++ path
            module.fused = can_fuse(module)
        if isinstance(module, GatedDeltaNet):
            module.fused_step = True
    return corrected
