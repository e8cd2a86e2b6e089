"""The sparse MoE layer over packed experts in one C++ call (clover/ops/csrc/moe.cpp, `woq.moe`) against its
reference (`woq.moe_reference`: token by token over the dequantised experts), and on a quantised hybrid model."""

from __future__ import annotations

import copy

import pytest
import torch
from model_helpers import tiny_model

from clover.model import CloverForBlockDiffusion, quantize
from clover.model.moe import Experts
from clover.model.quant import PackedExperts
from clover.ops import woq

E, H, I, SHARED_I = 8, 64, 32, 64


def _layer(kind: str, seed: int = 0) -> tuple[tuple, tuple, tuple, tuple]:
    """Random experts and a shared expert packed in `kind`: (gate_up, down, shared) as `woq.moe` takes them, and
    their dequantised weights as `woq.moe_reference` does."""
    torch.manual_seed(seed)
    gate_up, down = torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1
    shared_gate_up, shared_down, gate = torch.randn(2 * SHARED_I, H) * 0.1, torch.randn(H, SHARED_I) * 0.1, \
        torch.randn(H) * 0.1
    code = woq.KINDS[kind]
    packed = []
    for weights in (gate_up, down):
        p = woq.pack_experts(weights, kind)
        packed.append((p["qweight"], p["scale"], p["zero"], code, weights.shape[1], woq.DEFAULT_GROUP_SIZE))
    shared = []
    for weight in (shared_gate_up, shared_down):
        p = woq.pack(weight, kind)
        shared.append((p["qweight"][None], p["scale"][None], p["zero"][None], code, weight.shape[0],
                       woq.DEFAULT_GROUP_SIZE))
    dense = tuple(woq.unpack_experts(*args[:3], kind, args[4], w.shape[2]) for args, w in zip(packed, (gate_up, down)))
    dense_shared = tuple(woq.unpack(*(t[0] for t in args[:3]), kind, args[4], w.shape[1])
                         for args, w in zip(shared, (shared_gate_up, shared_down)))
    return tuple(packed), (*shared, gate), dense, (*dense_shared, gate)


@pytest.mark.parametrize("kind,bound", [("fp32", 1e-5), ("bf16", 1e-5), ("int8", 0.03), ("int4", 0.03)])
@pytest.mark.parametrize("vectorised", [True, False])
@pytest.mark.parametrize("with_shared,normalize,top_k,tokens", [(True, True, 2, 1), (True, False, 3, 7),
                                                                 (False, True, 1, 5)])
def test_grouped_moe_equals_its_reference(kind, bound, vectorised, with_shared, normalize, top_k, tokens):
    """fp32 / bf16 experts: the reference to fp32 rounding; int8 / int4 round each row's input and each expert's
    hidden row to int8 per group of 32 (~0.5 % rms each: woq's docstring), bounded at 3 % of the output's scale."""
    (gate_up, down), shared, dense, dense_shared = _layer(kind)
    x, router = torch.randn(tokens, H), torch.randn(E, H)
    got = woq.moe(x, router, top_k, normalize, gate_up, down, shared if with_shared else None, vectorised=vectorised)
    want = woq.moe_reference(x, router, top_k, normalize, *dense, dense_shared if with_shared else None)
    assert got.shape == want.shape
    assert (got - want).abs().max() <= bound * want.abs().max()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(kind):
    """Grouped by expert, a row shares its expert's tiles with whatever rows chose it: its bits must not change
    (a prompt's token computes as in a decoding step, a batch as one request)."""
    (gate_up, down), shared, _, _ = _layer(kind)
    x, router = torch.randn(40, H), torch.randn(E, H)
    together = woq.moe(x, router, 2, True, gate_up, down, shared)
    alone = torch.cat([woq.moe(x[i : i + 1], router, 2, True, gate_up, down, shared) for i in range(40)])
    assert torch.equal(together, alone)


def test_the_vectorised_and_portable_integer_paths_agree():
    """The same integer products on both paths; only the router's fp32 dot products may round differently."""
    (gate_up, down), shared, _, _ = _layer("int4")
    x, router = torch.randn(9, H), torch.randn(E, H)
    fast = woq.moe(x, router, 2, True, gate_up, down, shared)
    portable = woq.moe(x, router, 2, True, gate_up, down, shared, vectorised=False)
    torch.testing.assert_close(fast, portable, rtol=1e-5, atol=1e-5 * fast.abs().max().item())


def test_bad_input_is_refused():
    (gate_up, down), shared, _, _ = _layer("int4")
    x, router = torch.randn(3, H), torch.randn(E, H)
    with pytest.raises(RuntimeError, match="top_k must be in"):
        woq.moe(x, router, E + 1, True, gate_up, down)
    with pytest.raises(RuntimeError, match="stacked"):
        woq.moe(x, router[:4], 2, True, gate_up, down)
    with pytest.raises(RuntimeError, match="shared expert needs"):
        woq.moe(x, router, 2, True, gate_up, down, (shared[0], shared[1], None))
    with pytest.raises(RuntimeError, match="fp32"):
        woq.moe(x.double(), router, 2, True, gate_up, down)


@pytest.mark.parametrize("quant", ["int8", "int4"])
@torch.no_grad()
def test_quantised_hybrid_runs_its_moe_layers_grouped(quant, monkeypatch):
    """`quantize` packs the routed experts (the router and the shared expert's gate keep fp32) and the model's MoE
    layers run in one call each: the same logits as the module path over the dequantised experts, up to the
    rounding of the experts' activations."""
    model = quantize(tiny_model("clover-tiny"), quant)
    moe = model.model.layers[0].mlp
    assert isinstance(moe.experts, PackedExperts) and type(moe.shared_expert_gate) is torch.nn.Linear
    calls = []
    original = woq.moe
    monkeypatch.setattr(woq, "moe", lambda *a, **k: calls.append(1) or original(*a, **k))
    ids = torch.randint(0, 250, (2, 21))
    got = model(ids).logits
    assert len(calls) == model.config.num_hidden_layers
    monkeypatch.setattr(PackedExperts, "grouped", lambda self, moe, x: None)
    want = model(ids).logits  # each expert's dequantised weights, one matmul per expert (moe.run_experts)
    assert (got - want).pow(2).mean().sqrt() < 0.03 * want.pow(2).mean().sqrt()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("quant", ["int8", "int4"])
@torch.no_grad()
def test_quantised_hybrid_checkpoint_saves_and_loads(tmp_path, quant):
    model = quantize(tiny_model("clover-tiny"), quant)
    model.save_pretrained(tmp_path / "q")
    loaded = CloverForBlockDiffusion.from_pretrained(tmp_path / "q")
    assert isinstance(loaded.model.layers[0].mlp.experts, PackedExperts)
    ids = torch.randint(0, 250, (1, 12))
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_packed_experts_dequantise_to_the_rounded_experts():
    model = tiny_model("clover-tiny")
    experts: Experts = model.model.layers[0].mlp.experts
    packed = PackedExperts.from_experts(copy.deepcopy(experts), "int8")
    for proj, weight in (("gate_up", experts.gate_up_proj), ("down", experts.down_proj)):
        want = torch.stack([woq.unpack(**woq.pack(w, "int8"), kind="int8", out_features=w.shape[0],
                                       in_features=w.shape[1]) for w in weight.detach()])
        assert torch.equal(packed.dequantized(proj), want)
