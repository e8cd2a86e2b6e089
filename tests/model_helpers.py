"""Tiny random models for the tests (milliseconds to build), shared by engine, serving and decision tests."""

from __future__ import annotations

import torch

from clover import CloverConfig, CloverForBlockDiffusion
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
