"""Weight-only quantisation: the kernel equals its dequantising reference, quantised models equal dense models
of their dequantised weights (cached or not), quantised checkpoints round-trip, bad input is refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from model_helpers import tiny_model
from torch import nn

from clover.model import CloverForBlockDiffusion, quantize
from clover.model.lora import LoraConfig, apply_lora
from clover.model.quant import PackedLinear
from clover.ops import woq

KINDS = ["fp32", "bf16", "int8", "int4"]


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
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


def _quantised_activations(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x per row and group of K -> int8 codes (as floats) `[R, K/g, g]` and scales `sx [R, K/g]`."""
    groups = x.float().view(x.shape[0], -1, group_size)
    sx = groups.abs().amax(2) / 127
    q = torch.round(groups / torch.where(sx > 0, sx, 1)[..., None])
    return q, sx


def _integer_reference(x: torch.Tensor, packed: dict, kind: str, out_features: int, group_size: int) -> torch.Tensor:
    """The kernel's math in torch, from the logical codes: sum over groups of sw * sx * (q . qx), int4 also
    + mw * sx * sum(qx); the dot products in float64 (exact for these integers)."""
    in_features = x.shape[1]
    q, sw, mw = woq.unpack_codes(**packed, kind=kind, out_features=out_features, in_features=in_features)
    qx, sx = _quantised_activations(x, group_size)
    dot = torch.einsum("rgk,ogk->rog", qx.double(), q.double().view(out_features, -1, group_size))
    y = (dot * sw.double()[None] * sx.double()[:, None]).sum(2)
    if mw is not None:
        y = y + (mw.double()[None] * (sx.double() * qx.double().sum(2))[:, None]).sum(2)
    return y.float()


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("vectorised", [True, False])
@pytest.mark.parametrize("shape,group_size", [((37, 96), 8), ((37, 96), 16), ((64, 96), 24), ((37, 96), 32),
                                              ((16, 192), 48), ((50, 128), 64), ((21, 256), 128), ((8, 96), 96)])
def test_integer_kernel_equals_integer_reference(kind, vectorised, shape, group_size):
    """Both paths, every row-tile height and remainders, partial column blocks, group sizes from the smallest the
    format allows (8) up to the whole input, including ones that are not powers of two."""
    torch.manual_seed(0)
    out_features, in_features = shape
    w = torch.randn(out_features, in_features) * torch.linspace(0.1, 2, in_features)  # groups of different ranges
    packed = woq.pack(w, kind, group_size)
    for rows in (1, 2, 3, 4, 5, 8, 13, 17):
        x = torch.randn(rows, in_features) * torch.linspace(2, 0.05, in_features)
        x[0, :group_size] = 0  # an all-zero group: sx = 0
        want = _integer_reference(x, packed, kind, out_features, group_size)
        got = woq.woq_linear(x, **packed, kind=kind, out_features=out_features, group_size=group_size,
                             vectorised=vectorised)
        # exact integer dots; what differs is the fp32 order of the per-group sums (against float64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_integer_kernel_stays_within_the_activation_rounding_bound(kind):
    """Against the dequantised weights times the unrounded x: rounding x to sx * qx moves each element by at most
    sx / 2, so |y - W x| <= sum_k |W[o, k]| sx(k) / 2 for every output (plus fp32 rounding). On random data
    the rounding errors are independent and uniform over [-sx / 2, sx / 2] (variance sx^2 / 12), so the error's
    mean square is sum_k W[o, k]^2 sx(k)^2 / 12 (333 outputs: the ratio is 1 within ~4 standard errors)."""
    torch.manual_seed(0)
    out_features, in_features, group_size = 37, 256, 32
    packed = woq.pack(torch.randn(out_features, in_features), kind, group_size)
    x = torch.randn(9, in_features)
    got = woq.woq_linear(x, **packed, kind=kind, out_features=out_features, group_size=group_size)
    want = woq.reference_linear(x, **packed, kind=kind, out_features=out_features, group_size=group_size)
    _, sx = _quantised_activations(x, group_size)
    w = woq.unpack(**packed, kind=kind, out_features=out_features, in_features=in_features, group_size=group_size)
    bound = (sx.repeat_interleave(group_size, dim=1) / 2) @ w.abs().T
    err = (got - want).abs()
    assert bool((err <= bound * (1 + 1e-4) + 1e-5 * want.abs().max()).all())
    predicted = (sx.repeat_interleave(group_size, dim=1) ** 2 / 12) @ (w**2).T
    assert 0.7 < (err**2).mean() / predicted.mean() < 1.3


def test_codes_round_trip_through_the_packed_layout():
    torch.manual_seed(0)
    for kind in ("int8", "int4"):
        q, scale, zero = woq.quantize_groups(torch.randn(37, 64), kind, 16)
        back = woq.unpack_codes(**woq.pack_codes(q, scale, zero, kind), kind=kind, out_features=37, in_features=64)
        assert torch.equal(back[0], q) and torch.equal(back[1], scale)
        assert back[2] is None if kind == "int8" else torch.equal(back[2], zero)


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


@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-dense"])
@torch.no_grad()
def test_bf16_model_equals_its_dequantised_reference(preset):
    model = quantize(tiny_model(preset), "bf16")
    ref = _dense_reference(model)
    ids = torch.randint(0, 250, (2, 30))
    got, want = model(ids).logits, ref(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("preset,rms", [("clover-tiny", 0.05), ("clover-tiny-dense", 0.015)])
@torch.no_grad()
def test_quantised_model_stays_close_to_its_dequantised_reference(preset, quant, rms):
    """int8 / int4 layers also round their input to int8 per group: each adds a relative error of rms about
    (max|x| / rms|x|) / (127 sqrt(12)), ~0.5 % for a group of 32 normal values, which compounds over the layers
    (measured on the logits: 0.7 % for the dense preset, 2-2.4 % for the hybrid one, whose random DeltaNet
    layers and peaked head amplify it). Bounds: 2x those; and the next-token choices stay the reference's."""
    model = quantize(tiny_model(preset), quant)
    ref = _dense_reference(model)
    ids = torch.randint(0, 250, (2, 30))
    got, want = model(ids).logits, ref(ids).logits
    assert (got - want).pow(2).mean().sqrt() < rms * want.pow(2).mean().sqrt()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95


@torch.no_grad()
def test_bf16_weights_stay_close_to_fp32():
    """bf16 weights (8-bit mantissa, relative rounding 2^-9) move tiny_model's logits by well under 2 %."""
    model = tiny_model("clover-tiny-dense")
    ids = torch.randint(0, 250, (2, 30))
    want = model(ids).logits
    got = quantize(copy.deepcopy(model), "bf16")(ids).logits
    assert (got - want).abs().max() < 0.02 * want.abs().max()


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("preset", ["clover-tiny", "clover-tiny-dense"])
@torch.no_grad()
def test_quantised_cached_steps_equal_uncached_forward(preset, quant):
    """The kernel gives a row the same bits whatever block it is in (test below), so cached and uncached
    forwards agree as the unquantised model's do (1e-4), except where an fp32-rounding difference upstream (the
    hybrid's DeltaNet runs chunked uncached, recurrent cached) moves an activation across a rounding boundary of
    its int8 grid: that code then differs by one step, which moves later logits by up to ~1 % of their scale
    (one element of one group, sx / max|x| = 1 / 127, through the following layers). The tokens stay the same."""
    model = quantize(tiny_model(preset), quant)
    ids = torch.randint(0, 250, (2, 40))
    full = model(ids).logits
    cache = model.new_cache(2)
    pieces = [model(ids[:, :30], cache=cache).logits]
    pieces += [model(ids[:, t : t + 1], cache=cache).logits for t in range(30, 40)]
    got = torch.cat(pieces, 1)
    assert torch.equal(got.argmax(-1), full.argmax(-1))
    close = (got - full).abs() <= 1e-4 * full.abs().max()
    assert close.float().mean() >= 0.9 and (got - full).abs().max() <= 0.01 * full.abs().max()
    if preset == "clover-tiny-dense":  # attention only: cached rows see the same inputs to fp32 rounding
        assert bool(close.all())


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_integer_kernel_rows_do_not_depend_on_the_block(kind):
    """Each row is quantised and accumulated alone, in a fixed order: the same bits alone or in any block."""
    torch.manual_seed(0)
    packed = woq.pack(torch.randn(40, 128), kind)
    x = torch.randn(17, 128)
    block = woq.woq_linear(x, **packed, kind=kind, out_features=40)
    for r in (0, 5, 16):
        assert torch.equal(woq.woq_linear(x[r : r + 1], **packed, kind=kind, out_features=40), block[r : r + 1])


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


def test_checkpoint_of_another_layout_is_refused(tmp_path):
    """int8 / int4 codes were laid out differently before the layout was versioned: such a checkpoint (no
    "layout" in quantization.json), or one of a later layout, must not load as garbage."""
    quantize(tiny_model("clover-tiny-dense"), "int4").save_pretrained(tmp_path / "q")
    spec_path = tmp_path / "q" / "quantization.json"
    spec = json.loads(spec_path.read_text())
    assert spec["layout"] == woq.LAYOUT_VERSION
    for layout in (None, woq.LAYOUT_VERSION + 1):
        spec_path.write_text(json.dumps({k: v for k, v in spec.items() if k != "layout"} |
                                        ({} if layout is None else {"layout": layout})))
        with pytest.raises(ValueError, match=f"packed in layout {layout or 1}.*quantise the unquantised checkpoint"):
            CloverForBlockDiffusion.from_pretrained(tmp_path / "q")


def test_bad_input_is_refused():
    model = tiny_model("clover-tiny-dense")
    with pytest.raises(ValueError, match="unknown quantisation 'int3'"):
        quantize(model, "int3")
    with pytest.raises(ValueError, match="input dimension 64 is not a multiple of 48"):
        quantize(copy.deepcopy(model), "int4", group_size=48)
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 8, got 12"):
        quantize(copy.deepcopy(model), "int8", group_size=12)
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
