"""Gated DeltaNet's one-token decoding step in one C++ call (clover/ops/csrc/deltanet.cpp) against the module path
it replaces (the conv, `recurrent_gated_delta_rule`, the gated norm): the same outputs and cache to fp32 rounding."""

from __future__ import annotations

import pytest
import torch
from model_helpers import assert_close_up_to_activation_rounding, tiny_model

from clover.model.deltanet import GatedDeltaNet
from clover.model.quant import quantize


def _steps(model, ids: torch.Tensor, fused: bool, rewind_at: int | None = None) -> tuple[torch.Tensor, list]:
    for module in model.modules():
        if isinstance(module, GatedDeltaNet):
            module.fused_step = fused
    cache = model.new_cache(ids.shape[0])
    pieces = [model(ids[:, :8], cache=cache).logits]
    for t in range(8, ids.shape[1]):
        if t == rewind_at:  # a step recorded, then forgotten: the cache must be as before it
            cache.mark()
            model(ids[:, t : t + 1], cache=cache)
            cache.rewind(torch.zeros(ids.shape[0], dtype=torch.long))
        pieces.append(model(ids[:, t : t + 1], cache=cache).logits)
    states = [(layer.state.clone(), layer.conv.clone()) for layer in cache.layers if hasattr(layer, "state")]
    return torch.cat(pieces, 1), states


@pytest.mark.parametrize("deltanet_reading", ["block_bidirectional", "causal"])
@pytest.mark.parametrize("rewind_at", [None, 10])
@torch.no_grad()
def test_fused_step_equals_the_module_path(deltanet_reading, rewind_at, monkeypatch):
    model = tiny_model("clover-tiny", deltanet_reading=deltanet_reading)
    ids = torch.randint(0, 250, (2, 16))
    calls, step = [], GatedDeltaNet._fused_step
    monkeypatch.setattr(GatedDeltaNet, "_fused_step", lambda self, *a: calls.append(1) or step(self, *a))
    got, got_states = _steps(model, ids, True, rewind_at)
    assert len(calls) == len(got_states) * (ids.shape[1] - 8 + (rewind_at is not None))
    want, want_states = _steps(model, ids, False, rewind_at)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert len(got_states) == sum(isinstance(m, GatedDeltaNet) for m in model.modules()) > 0
    for (state, conv), (ref_state, ref_conv) in zip(got_states, want_states):
        torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(conv, ref_conv, rtol=1e-5, atol=1e-6)  # inputs, after the layers before


@torch.no_grad()
def test_tokens_stepped_together_get_the_bits_they_get_alone():
    """A forward of several causal tokens after the cache steps them in turn: the same logits, bit for bit, as
    forwards of one token each (exact mode's verification against block size 1: packed projections and the grouped
    MoE give a row the same bits whatever rows share its forward), and the module path's up to the rounding of the
    activations (its chunked rule computes other fp32 bits upstream)."""
    model = quantize(tiny_model("clover-tiny", num_hidden_layers=3, layer_types=["linear_attention"] * 3), "int4")
    ids = torch.randint(0, 250, (2, 14))
    together = model.new_cache(2)
    model(ids[:, :8], cache=together)
    got = model(ids[:, 8:], cache=together).logits
    alone = model.new_cache(2)
    model(ids[:, :8], cache=alone)
    want = torch.cat([model(ids[:, t : t + 1], cache=alone).logits for t in range(8, 14)], 1)
    assert torch.equal(got, want)
    for module in model.modules():
        if isinstance(module, GatedDeltaNet):
            module.fused_step = False
    chunked = model.new_cache(2)
    model(ids[:, :8], cache=chunked)
    ref = model(ids[:, 8:], cache=chunked).logits
    assert_close_up_to_activation_rounding(got, ref)
