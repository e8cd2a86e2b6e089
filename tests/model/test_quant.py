"""Weight-only quantisation: the kernel equals its dequantising reference, quantised models equal dense models
of their dequantised weights (cached or not), quantised checkpoints round-trip, bad input is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from model_helpers import tiny_model
from torch import nn

from clover.model import CloverForBlockDiffusion, quantize
from clover.model.lora import LoraConfig, apply_lora
from clover.model.quant import PackedLinear
from clover.ops import woq

KINDS = ["fp32", "bf16", "int8", "int4"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vectorised", [True, False])
@pytest.mark.parametrize("shape", [(37, 64), (96, 128), (16, 512)])  # 37: a partial 16-column block; 512: 2 tiles
def test_kernel_equals_dequantised_reference(kind, vectorised, shape):
    torch.manual_seed(0)
    out_features, in_features = shape
    packed = woq.pack(torch.randn(out_features, in_features), kind)
    for rows in (1, 2, 5, 6, 7, 13):  # every register-tile height, and tiles plus a remainder
        x = torch.randn(rows, in_features)
        ref = woq.reference_linear(x, **packed, kind=kind, out_features=out_features)
        got = woq.woq_linear(x, **packed, kind=kind, out_features=out_features, vectorised=vectorised)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())  # fp32 sum order


@pytest.mark.parametrize("kind,levels", [("int8", 127), ("int4", 15)])
def test_quantisation_error_is_half_a_step(kind, levels):
    torch.manual_seed(0)
    w = torch.randn(48, 96) * torch.linspace(0.01, 3, 96)  # groups of very different ranges
    back = woq.unpack(**woq.pack(w, kind), kind=kind, out_features=48, in_features=96)
    groups = w.view(48, 3, 32)
    span = groups.abs().amax(2) if kind == "int8" else groups.amax(2) - groups.amin(2)
    step = (span / levels).repeat_interleave(32, dim=1)
    assert bool(((back - w).abs() <= step * 0.5 * 1.01 + 1e-3 * step).all())  # fp16 scales: 0.1 % slack


def _dense_reference(model: CloverForBlockDiffusion) -> CloverForBlockDiffusion:
    """The quantised model with each packed layer replaced by an nn.Linear of its dequantised weights."""
    ref = copy.deepcopy(model)
    for name, module in list(ref.named_modules()):
        if isinstance(module, PackedLinear):
            dense = nn.Linear(module.in_features, module.out_features, bias=False)
            dense.weight = nn.Parameter(module.dequantized())
            owner, _, attr = name.rpartition(".")
            setattr(ref.get_submodule(owner), attr, dense)
    return ref


@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-dense"])
@torch.no_grad()
def test_fp32_fast_forward_equals_reference(preset):
    model = tiny_model(preset)
    ids, q = torch.randint(0, 250, (2, 21)), torch.randint(0, 250, (2, 8))  # clean tokens, two query blocks
    fast = quantize(copy.deepcopy(model), "fp32")
    assert fast.model.layers[-1].self_attn.qkv_proj is not None  # q/k/v fused
    ref = model(ids, block_size=4, prefix_len=5, query_ids=q).query_logits
    got = fast(ids, block_size=4, prefix_len=5, query_ids=q).query_logits
    # logits are ~30x the hidden state (tiny_model's peaked head): 1e-5 relative to their scale
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("quant", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-dense"])
@torch.no_grad()
def test_quantised_model_equals_its_dequantised_reference(preset, quant):
    model = quantize(tiny_model(preset), quant)
    ref = _dense_reference(model)
    ids = torch.randint(0, 250, (2, 30))
    got, want = model(ids).logits, ref(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@torch.no_grad()
def test_bf16_weights_stay_close_to_fp32():
    """bf16 weights (8-bit mantissa, relative rounding 2^-9) move tiny_model's logits by well under 2 %."""
    model = tiny_model("clover-tiny-dense")
    ids = torch.randint(0, 250, (2, 30))
    want = model(ids).logits
    got = quantize(copy.deepcopy(model), "bf16")(ids).logits
    assert (got - want).abs().max() < 0.02 * want.abs().max()


@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-dense"])
@torch.no_grad()
def test_quantised_cached_steps_equal_uncached_forward(preset):
    model = quantize(tiny_model(preset), "int4")
    ids = torch.randint(0, 250, (2, 40))
    full = model(ids).logits
    cache = model.new_cache(2)
    pieces = [model(ids[:, :30], cache=cache).logits]
    pieces += [model(ids[:, t : t + 1], cache=cache).logits for t in range(30, 40)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-4, atol=1e-4 * full.abs().max().item())


@pytest.mark.parametrize("quant", ["int8", "int4"])
@torch.no_grad()
def test_quantised_checkpoint_saves_and_loads(tmp_path, quant):
    model = quantize(tiny_model("clover-tiny-dense"), quant)
    model.save_pretrained(tmp_path / "q")
    assert (tmp_path / "q" / "quantization.json").is_file()
    loaded = CloverForBlockDiffusion.from_pretrained(tmp_path / "q")
    assert loaded.quantization == model.quantization and isinstance(loaded.lm_head, PackedLinear)
    ids = torch.randint(0, 250, (1, 12))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    cast = CloverForBlockDiffusion.from_pretrained(tmp_path / "q", dtype=torch.bfloat16)
    for name, t in model.state_dict().items():  # the packed bits survive a dtype cast at load
        if name.endswith(("qweight", "scale", "zero")):
            assert torch.equal(cast.state_dict()[name], t), name


def test_bad_input_is_refused():
    model = tiny_model("clover-tiny-dense")
    with pytest.raises(ValueError, match="unknown quantisation 'int3'"):
        quantize(model, "int3")
    with pytest.raises(ValueError, match="input dimension 64 is not a multiple of 48"):
        quantize(copy.deepcopy(model), "int4", group_size=48)
    with pytest.raises(ValueError, match="not a multiple of 8"):
        woq.pack(torch.randn(4, 12), "bf16")
    adapted = copy.deepcopy(model)
    apply_lora(adapted, LoraConfig(rank=2, targets=["q_proj"], train_rows=[]))
    with pytest.raises(ValueError, match="merge the adapter"):
        quantize(adapted, "int8")
    quantize(model, "int8")
    with pytest.raises(ValueError, match="already quantised"):
        quantize(model, "int4")


def test_none_leaves_the_model_alone():
    model = tiny_model("clover-tiny-dense")
    assert quantize(model, "none") is model and isinstance(model.lm_head, nn.Linear)
