"""Gated DeltaNet's one-token decoding step in one C++ call (clover/ops/csrc/deltanet.cpp) against the module path
it replaces (the conv, `recurrent_gated_delta_rule`, the gated norm): the same outputs and cache to fp32 rounding."""

from __future__ import annotations

import pytest
import torch
from model_helpers import tiny_model

from clover.model.deltanet import GatedDeltaNet


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
