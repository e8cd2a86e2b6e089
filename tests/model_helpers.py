"""Tiny random models for the tests (milliseconds to build), shared by engine, serving and decision tests."""

from __future__ import annotations

import copy

import torch

from clover import CloverConfig, CloverForBlockDiffusion
from clover.model.lora import apply_lora
from clover.training.config import LoraConfig
from clover.model.deltanet import GatedDeltaNet

PROMPTS = [[5, 17, 3, 99, 42, 7, 11], [8, 120], [64, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


def tiny_model(preset: str = "clover-tiny", seed: int = 0, logit_scale: float = 30.0,
               **overrides) -> CloverForBlockDiffusion:
    """A random tiny model that exercises what decoding depends on.

    Clover-only parameters (right conv, memory calibration) are randomised so the block-bidirectional paths are
    not identities, and the final norm is scaled up so random logits are peaked: thresholds < 1 then accept
    several positions per step. The dense preset's embeddings are untied (tied random ones just repeat the input).
    """
    if preset == "clover-tiny-dense":
        overrides.setdefault("tie_word_embeddings", False)
    torch.manual_seed(seed)
    model = CloverForBlockDiffusion(CloverConfig.from_preset(preset, **overrides)).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, GatedDeltaNet):
                module.conv1d_right.weight.normal_(std=0.3)
                module.memory_calibration.normal_(std=0.5)
        norm = model.model.norm.weight
        if model.config.norm_type == "plain":
            norm.mul_(logit_scale)
        else:
            norm.copy_((1 + norm) * logit_scale - 1)
    return model


def dequantised_matmul(monkeypatch) -> None:
    """Packed layers run `woq.reference_linear` (dequantise + fp32 matmul), layer by layer: for tests of what is
    packed (weights, corrections), which the CPU kernel's rounding of the activations (~1 % of an output, held to
    that matmul by the kernel tests) would hide. The fused C++ layer calls the kernel itself, so it is off too."""
    from clover.model import modeling
    from clover.model.quant import PackedExperts
    from clover.ops import woq

    monkeypatch.setattr(woq, "woq_linear", lambda *args, activations="int8", correction_tiles=None, **kwargs:
                        woq.reference_linear(*args, **kwargs))
    monkeypatch.setattr(modeling, "runs_fused", lambda h, ctx: False)
    monkeypatch.setattr(PackedExperts, "grouped", lambda self, moe, x: None)  # the dequantised experts as modules


def assert_close_up_to_activation_rounding(got: torch.Tensor, want: torch.Tensor, close_share: float = 0.0) -> None:
    """Logits of int8 / int4 kernels computed two ways whose fp32 rounding differs upstream: where that moves an
    activation across a rounding boundary of its int8 grid, the code differs by one step, which moves later
    logits by up to ~1 % of their scale (one element of one group, sx / max|x| = 1 / 127, through the following
    layers). The argmax tokens stay the same; at least `close_share` of the logits agree to 1e-4 (a step early in
    a causal sequence moves every later position)."""
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    close = (got - want).abs() <= 1e-4 * want.abs().max()
    assert close.float().mean() >= close_share and (got - want).abs().max() <= 0.01 * want.abs().max()


def base_and_gated(preset: str = "clover-tiny-dense", seed: int = 0, **lora) -> tuple[CloverForBlockDiffusion,
                                                                                         CloverForBlockDiffusion]:
    """A random base and a copy with a gated adapter whose factors and [MASK] row are all nonzero."""
    torch.manual_seed(seed)
    base = CloverForBlockDiffusion(CloverConfig.from_preset(preset)).eval()
    model = copy.deepcopy(base)
    apply_lora(model, LoraConfig(**{"rank": 4, "gated": True, "extra_trainable": [], **lora}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "row_delta" in name:
                param.normal_(0.0, 0.2)
    return base, model
