"""Weight-only quantisation: the kernel equals its dequantising reference (and, for int8 / int4, a torch
reference of its integer math with one or two activation passes), quantised models equal dense models of their
dequantised weights (cached or not), round to nearest gives back the codes of a Q4_1 / Q8_0 tensor, an unmerged
adapter is kept exactly beside the quantised base, quantised checkpoints round-trip, bad input is refused."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from model_helpers import assert_close_up_to_activation_rounding, dequantised_matmul, tiny_model
from torch import nn

from clover.model import CloverForBlockDiffusion, quantize
from clover.model.lora import LoraConfig, LoRALinear, TrainableRowsEmbedding, apply_lora, has_lora
from clover.model import prompt_rows, quant
from clover.model.moe import Experts, SparseMoE
from clover.model.quant import PackedExperts, PackedLinear, default_activations, default_head
from clover.ops import woq

KINDS = ["fp32", "bf16", "int8", "int4"]


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
@pytest.mark.parametrize("vectorised", [True, False])
@pytest.mark.parametrize("shape", [(37, 64), (96, 128), (16, 512)])  # 37: a partial 16-column block; 512: 2 tiles
def test_kernel_equals_dequantised_reference(kind, vectorised, shape):
    torch.manual_seed(0)
    out_features, in_features = shape
    packed = woq.pack(torch.randn(out_features, in_features), kind)
    for rows in (1, 2, 3, 4, 5, 6, 7, 13):  # every register-tile height, and tiles plus a remainder
        x = torch.randn(rows, in_features)
        ref = woq.reference_linear(x, **packed, kind=kind, out_features=out_features)
        got = woq.woq_linear(x, **packed, kind=kind, out_features=out_features, vectorised=vectorised)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())  # fp32 sum order


@pytest.mark.parametrize("kind", ["bf16", "int4"])
@pytest.mark.parametrize("vectorised", [True, False])
@pytest.mark.parametrize("shape,rank", [((37, 64), 3), ((600, 136), 16)])  # 600: past one 512-column task;
# 136: a dot product's tail past its 16-wide steps
def test_kernel_adds_the_low_rank_correction(kind, vectorised, shape, rank):
    """A correction `(A [r, K], B' [r, O])` (fp16 as int16 bits, `pack_correction`) adds `(x A^T) B'` to what the
    kernel computes, in x's dtype."""
    torch.manual_seed(0)
    out_features, in_features = shape
    packed = woq.pack(torch.randn(out_features, in_features), kind, group_size=8)
    correction = woq.pack_correction(torch.randn(rank, in_features), torch.randn(rank, out_features))
    a, b = (t.view(torch.float16).float() for t in correction)
    args = {**packed, "kind": kind, "out_features": out_features, "group_size": 8}
    for rows in (1, 5):
        x = torch.randn(rows, 2, in_features)
        want = woq.woq_linear(x, **args, vectorised=vectorised) + (x @ a.T) @ b
        got = woq.woq_linear(x, **args, correction=correction, vectorised=vectorised)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        ref = woq.reference_linear(x, **args, correction=correction)
        torch.testing.assert_close(ref, woq.reference_linear(x, **args) + (x @ a.T) @ b, rtol=1e-5,
                                   atol=1e-5 * want.abs().max().item())
    assert woq.woq_linear(x.bfloat16(), **args, correction=correction).dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["fp32", "int4"])
@pytest.mark.parametrize("vectorised", [True, False])
def test_a_gated_correction_acts_at_query_rows_only(kind, vectorised):
    """`gate=(T, start)`: the rows are a flattened [N, T] grid and only positions >= start (the query stream) get
    the correction; the others are exactly the uncorrected kernel's."""
    torch.manual_seed(0)
    packed = woq.pack(torch.randn(40, 64), kind, group_size=8)
    correction = woq.pack_correction(torch.randn(4, 64), torch.randn(4, 40))
    args = {**packed, "kind": kind, "out_features": 40, "group_size": 8, "vectorised": vectorised}
    x = torch.randn(3, 7, 64)
    plain, full = woq.woq_linear(x, **args), woq.woq_linear(x, **args, correction=correction)
    for start in (0, 5, 7):
        got = woq.woq_linear(x, **args, correction=correction, gate=(7, start))
        assert torch.equal(got[:, :start], plain[:, :start]) and torch.equal(got[:, start:], full[:, start:])
        ref = woq.reference_linear(x, **{k: v for k, v in args.items() if k != "vectorised"}, correction=correction,
                                   gate=(7, start))
        if kind == "fp32":  # int4 rounds the activations, which the reference does not
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        assert torch.equal(ref[:, :start], woq.reference_linear(x, **{k: v for k, v in args.items()
                                                                      if k != "vectorised"})[:, :start])


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("group_size", [8, 32])
@pytest.mark.parametrize("vectorised", [True, False])
def test_dequantize_equals_unpack(kind, group_size, vectorised):
    """The extension's `dequantize` gives `unpack`'s weights bit for bit (37: a partial 16-column block), on the
    AVX2 path and on the portable loops."""
    torch.manual_seed(0)
    packed = woq.pack(torch.randn(37, 64) * 3 + 1, kind, group_size=group_size)
    want = woq.unpack(**packed, kind=kind, out_features=37, in_features=64, group_size=group_size)
    got = woq.dequantize(**packed, kind=kind, out_features=37, in_features=64, group_size=group_size,
                         vectorised=vectorised)
    assert got.shape == (37, 64) and torch.equal(got, want)
    with pytest.raises(RuntimeError, match="do not match"):
        woq.dequantize(**packed, kind=kind, out_features=64, in_features=64, group_size=group_size)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_prompt_rows_rounded_twice_multiply_as_prompt_matmul_says(kind, monkeypatch):
    """Inside `reading_prompt()` a layer that rounds its input twice runs the kernel by default and, with
    `CLOVER_PROMPT_MATMUL=fp32`, the dequantised weights' fp32 matmul (its gated correction included), whatever
    the rows, within the kernel's activation rounding of it; outside, and with one pass, the kernel runs however
    many rows there are. An unknown choice is refused by name."""
    torch.manual_seed(0)
    layer = PackedLinear.from_weight(torch.randn(40, 64), kind, group_size=8, activations="int8x2",
                                     correction=(torch.randn(4, 64), torch.randn(4, 40)))
    args = dict(qweight=layer.qweight, scale=layer.scale, zero=layer.zero, kind=kind, out_features=40, group_size=8,
                correction=(layer.correction_a, layer.correction_b))
    x = torch.randn(4, 64, 64)
    kernel = woq.woq_linear(x, **args, activations="int8x2")
    monkeypatch.delenv("CLOVER_PROMPT_MATMUL", raising=False)
    with prompt_rows.reading_prompt():
        assert torch.equal(layer(x), kernel)
    monkeypatch.setenv("CLOVER_PROMPT_MATMUL", "fp32")
    with prompt_rows.reading_prompt():
        assert torch.equal(layer(x), woq.reference_linear(x, **args))
        assert torch.equal(layer(x[:, :3]), woq.reference_linear(x[:, :3], **args))
        with prompt_rows.reading_prompt(False):
            assert torch.equal(layer(x), kernel)
    assert torch.equal(layer(x), kernel)
    assert_close_up_to_activation_rounding(woq.reference_linear(x, **args), kernel)
    layer.activations = "int8"
    with prompt_rows.reading_prompt():
        assert torch.equal(layer(x), woq.woq_linear(x, **args, activations="int8"))
    monkeypatch.setenv("CLOVER_PROMPT_MATMUL", "bf16")
    with pytest.raises(ValueError, match="CLOVER_PROMPT_MATMUL must be one of kernel, fp32; got 'bf16'"):
        prompt_rows.prompt_matmul()


@pytest.mark.parametrize("matmul", ["kernel", "fp32"])
def test_a_prompt_rows_bits_do_not_depend_on_how_many_rows_share_its_forward(matmul, monkeypatch):
    """The kernel computes each row alone; BLAS picks its kernel by the row count (MKL's fp32 one gives a few rows
    other bits than many), so the dense path pads rows to `woq.ROW_TILE`: either way exact mode's first forward (a
    prompt chunk and query rows) reads the prompt with block size 1's bits. With a correction on every row, as an
    ungated adapter has."""
    monkeypatch.setenv("CLOVER_PROMPT_MATMUL", matmul)
    torch.manual_seed(0)
    layer = PackedLinear.from_weight(torch.randn(960, 576), "int4", activations="int8x2",
                                     correction=(torch.randn(8, 576), torch.randn(8, 960) * 0.01))
    x = torch.randn(300, 576)
    with prompt_rows.reading_prompt():
        full = layer(x)
        for rows in (*range(1, 20), 31, 33, 255, 257):
            assert torch.equal(layer(x[:rows]), full[:rows]), rows


def test_correction_is_stored_in_fp16_balanced_per_rank():
    """`pack_correction` rescales each rank's rows of A and B' to the same peak before rounding to fp16: the
    product stays to fp16's precision even where B' alone sits far below fp16's normal range (an adapter with a
    small scaling), where rounding B' as it is would flush it to subnormals; what fp16 cannot hold is refused."""
    torch.manual_seed(0)
    a, b = torch.randn(4, 64), torch.randn(4, 48) * 1e-6
    want = a.T.double() @ b.double()
    a16, b16 = (t.view(torch.float16).double() for t in woq.pack_correction(a, b))
    assert (a16.abs().amax(1) - b16.abs().amax(1)).abs().max() <= 1e-3 * a16.abs().amax()
    assert ((a16.T @ b16 - want).abs().max() / want.abs().max()) < 2e-3  # two fp16 roundings
    naive = a.half().double().T @ b.half().double()
    assert ((naive - want).abs().max() / want.abs().max()) > 1e-2  # subnormal B' as it is
    zero = woq.pack_correction(a, torch.zeros(4, 48))  # an adapter that has not moved stays exactly zero
    assert torch.equal(zero[1], torch.zeros(4, 48, dtype=torch.int16))
    with pytest.raises(ValueError, match="up_proj.*does not fit fp16"):
        woq.pack_correction(a, b.clone().fill_(float("nan")), name="up_proj")


def _quantised_activations(x: torch.Tensor, group_size: int,
                           activations: str = "int8") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """x per row and group of K -> per pass, int8 codes (as floats) `[R, K/g, g]` and steps `[R, K/g]`: pass 1
    rounds x at s1 = max|x| / 127, pass 2 (int8x2) the residual x - s1 q1, formed in float64 (exact: s1 q1 has at
    most 31 significant bits, and |r| <= s1 / 2 <= |x|'s range) and rounded once to fp32, as the kernel's fma, at
    the fixed step s2 = s1 / 254."""
    groups = x.float().view(x.shape[0], -1, group_size)
    step = groups.abs().amax(2) / 127
    passes = []
    for _ in range(woq.ACTIVATIONS[activations]):
        q = torch.round(groups / torch.where(step > 0, step, 1)[..., None]).clamp(-127, 127)
        passes.append((q, step))
        groups = (groups.double() - step.double()[..., None] * q.double()).float()
        step = step / 254
    return passes


def _integer_reference(x: torch.Tensor, packed: dict, kind: str, out_features: int, group_size: int,
                       activations: str = "int8") -> torch.Tensor:
    """The kernel's math in torch, from the logical codes: x's code per group Q = qx (two passes: 254 q1 + q2) at
    the last pass's step s, then the sum over groups of sw * s * (q . Q), int4 also + mw * s * sum(Q); the dot
    products in float64 (exact for these integers)."""
    in_features = x.shape[1]
    q, sw, mw = woq.unpack_codes(**packed, kind=kind, out_features=out_features, in_features=in_features)
    qx, sx = 0, None
    for digit, sx in _quantised_activations(x, group_size, activations):
        qx = qx * 254 + digit.double()
    dot = torch.einsum("rgk,ogk->rog", qx, q.double().view(out_features, -1, group_size))
    y = (dot * sw.double()[None] * sx.double()[:, None]).sum(2)
    if mw is not None:
        y += (mw.double()[None] * (sx.double() * qx.sum(2))[:, None]).sum(2)
    return y.float()


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("activations", ["int8", "int8x2"])
@pytest.mark.parametrize("vectorised", [True, False])
@pytest.mark.parametrize("shape,group_size", [((37, 96), 8), ((37, 96), 16), ((64, 96), 24), ((37, 96), 32),
                                              ((16, 192), 48), ((50, 128), 64), ((21, 256), 128), ((8, 96), 96)])
def test_integer_kernel_equals_integer_reference(kind, activations, vectorised, shape, group_size):
    """Both paths, one or two activation passes, every row-tile height and remainders (two passes: two rows of
    codes per row), partial column blocks, group sizes from the smallest the format allows (8) up to the whole
    input, including ones that are not powers of two."""
    torch.manual_seed(0)
    out_features, in_features = shape
    w = torch.randn(out_features, in_features) * torch.linspace(0.1, 2, in_features)  # groups of different ranges
    packed = woq.pack(w, kind, group_size)
    for rows in (1, 2, 3, 4, 5, 8, 13, 17):
        x = torch.randn(rows, in_features) * torch.linspace(2, 0.05, in_features)
        x[0, :group_size] = 0  # an all-zero group: sx = 0
        x[-1, -group_size:] = torch.randint(-126, 127, (group_size,))  # integers, max 127: sx = 1 and x on the
        x[-1, -1] = 127  # int8 grid, so the residual is zero (s2 = 0)
        want = _integer_reference(x, packed, kind, out_features, group_size, activations)
        got = woq.woq_linear(x, **packed, kind=kind, out_features=out_features, group_size=group_size,
                             vectorised=vectorised, activations=activations)
        # exact integer dots; what differs is the fp32 order of the per-group sums (against float64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("activations", ["int8", "int8x2"])
@pytest.mark.parametrize("shape,group_size", [((37, 96), 8), ((64, 96), 24), ((37, 96), 32), ((50, 128), 64),
                                              ((200, 576), 32)])
def test_the_vector_tiles_give_the_portable_paths_bits(kind, activations, shape, group_size):
    """The AVX2 (or AVX-512 VNNI) tiles compute the portable path's integers and its fp32 epilogue in the same order,
    so the same bits, at every row count: int4's groups of 32 summed in 16 bits, int8 with two passes through one
    joined 16-bit code (`int_tile_wide_avx2`), odd rows and partial column blocks included. A tile that puts a
    column or a row of codes in the wrong place, or overflows, changes the bits."""
    if not woq.has_avx2():
        pytest.skip("this CPU has no AVX2: only the portable path runs here")
    torch.manual_seed(0)
    out_features, in_features = shape
    packed = woq.pack(torch.randn(out_features, in_features) * torch.linspace(0.1, 2, in_features), kind, group_size)
    for rows in (1, 2, 3, 4, 5, 8, 13, 17):
        x = torch.randn(rows, in_features) * torch.linspace(2, 0.05, in_features)
        x[-1, -group_size:] = 127  # the largest codes: Q = 254 x 127
        got, want = (woq.woq_linear(x, **packed, kind=kind, out_features=out_features, group_size=group_size,
                                    vectorised=vectorised, activations=activations) for vectorised in (True, False))
        assert torch.equal(got, want), (rows, (got - want).abs().max().item())


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("activations", ["int8", "int8x2"])
def test_integer_kernel_stays_within_the_activation_rounding_bound(kind, activations):
    """Against the dequantised weights times the unrounded x (float64): the last pass's rounding moves each element
    by at most s / 2 (one pass: s = sx = max|x| / 127; two: s = s2 = sx / 254, the residual being at most sx / 2),
    so |y - W x| <= sum_k |W[o, k]| s(k) / 2 for every output (plus fp32 rounding). On random data the rounding
    errors are independent and uniform over [-s / 2, s / 2] (variance s^2 / 12), so the error's mean square is
    sum_k W[o, k]^2 s(k)^2 / 12 (333 outputs: the ratio is 1 within ~4 standard errors). Two passes: the rms error
    is over 200x smaller than one pass's."""
    torch.manual_seed(0)
    out_features, in_features, group_size = 37, 256, 32
    packed = woq.pack(torch.randn(out_features, in_features), kind, group_size)
    x = torch.randn(9, in_features)
    w = woq.unpack(**packed, kind=kind, out_features=out_features, in_features=in_features, group_size=group_size)
    want = x.double() @ w.double().T

    def error(activations: str) -> torch.Tensor:
        return woq.woq_linear(x, **packed, kind=kind, out_features=out_features, group_size=group_size,
                              activations=activations).double() - want

    err = error(activations).abs()
    _, s = _quantised_activations(x, group_size, activations)[-1]
    step = s.double().repeat_interleave(group_size, dim=1)
    bound = (step / 2) @ w.double().abs().T
    assert bool((err <= bound * (1 + 1e-4) + 1e-6 * want.abs().max()).all())
    predicted = (step**2 / 12) @ (w.double() ** 2).T
    assert 0.7 < (err**2).mean() / predicted.mean() < 1.3
    if activations == "int8x2":
        assert (err**2).mean().sqrt() < (error("int8") ** 2).mean().sqrt() / 200


def test_two_passes_refuse_groups_whose_dot_products_overflow_int32():
    """Two passes join a group's dot products in int32 (254 dot1 + dot2): int8 groups past 522 weights could
    overflow it, and are refused by name; one pass takes them, and int4 (codes up to 15) takes far wider groups."""
    torch.manual_seed(0)
    x = torch.randn(2, 1056)
    for kind, group, fits in (("int8", 528, False), ("int8", 264, True), ("int4", 1056, True)):
        packed = woq.pack(torch.randn(16, 1056), kind, group)
        args = dict(**packed, kind=kind, out_features=16, group_size=group)
        assert woq.woq_linear(x, **args, activations="int8").shape == (2, 16)
        if fits:
            torch.testing.assert_close(woq.woq_linear(x, **args, activations="int8x2"),
                                       _integer_reference(x, packed, kind, 16, group, "int8x2"), rtol=1e-5, atol=1e-4)
        else:
            with pytest.raises(RuntimeError, match="int8x2.*overflow int32 in int8 groups of 528 weights: at most 522"):
                woq.woq_linear(x, **args, activations="int8x2")


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


def test_round_to_nearest_gives_back_the_codes_of_q4_1_and_q8_0():
    """A tensor dequantised from llama.cpp's Q4_1 (`d * q + m`, fp16 d and m, every group spanning codes 0..15, as
    its quantiser makes them) or Q8_0 (`d * q`, some |q| = 127 per group) quantises back to the same codes and
    fp16 scales (and minima) bit for bit, so packing it loses nothing."""
    gen = torch.Generator().manual_seed(0)
    groups, size = 4096, 32
    ends = torch.rand(groups, size, generator=gen).argsort(dim=1)[:, :2]  # where each group's extremes sit
    d = (10 ** (torch.rand(groups, 1, generator=gen) * 3 - 4)).half()  # scales from 1e-4 to 1e-1
    m = (d.float() * (torch.rand(groups, 1, generator=gen) * 18 - 15)).half()  # minima from -15 d to 3 d

    q4 = torch.randint(0, 16, (groups, size), generator=gen)
    q4.scatter_(1, ends, torch.tensor([0, 15]).expand(groups, 2))
    w4 = (d.float() * q4 + m.float()).view(-1, 128)  # gguf's dequantisation, in fp32
    codes, scale, zero = woq.quantize_groups(w4, "int4")
    assert torch.equal(codes.view(groups, size), q4.to(torch.uint8))
    assert torch.equal(scale.view(groups, 1), d) and torch.equal(zero.view(groups, 1), m)
    assert torch.equal(woq.unpack(**woq.pack(w4, "int4"), kind="int4", out_features=w4.shape[0], in_features=128), w4)

    q8 = torch.randint(-127, 128, (groups, size), generator=gen)
    q8.scatter_(1, ends[:, :1], torch.where(torch.rand(groups, 1, generator=gen) < 0.5, -127, 127))
    w8 = (d.float() * q8).view(-1, 128)
    codes, scale, _ = woq.quantize_groups(w8, "int8")
    assert torch.equal(codes.view(groups, size), q8.to(torch.int8)) and torch.equal(scale.view(groups, 1), d)
    assert torch.equal(woq.unpack(**woq.pack(w8, "int8"), kind="int8", out_features=w8.shape[0], in_features=128), w8)


def _adapted(preset: str, **overrides) -> CloverForBlockDiffusion:
    """A tiny model with a trained-looking rank-4 adapter on every default target and the mask token's row."""
    model = tiny_model(preset, **overrides)
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("lora_B", "row_delta")):  # zero at init: give the adapter something to do
                param.normal_(std=0.3)
    return model


def _adapted_reference(adapted: CloverForBlockDiffusion, quant: str) -> CloverForBlockDiffusion:
    """The adapted model computed unquantised in fp32 from its round-to-nearest base: every linear layer's base
    weight dequantised (`woq.unpack` of `woq.pack`), the LoRA kept as `F.linear` ops beside it with the fp16 values
    the correction stores (`woq.pack_correction`: the tiny random models amplify even that rounding ~300x), the
    mask row's delta merged into the embedding, the LM head (untied) dequantised in its own format."""
    ref = copy.deepcopy(adapted)

    def rounded(weight: torch.Tensor, kind: str) -> torch.Tensor:
        return woq.unpack(**woq.pack(weight, kind), kind=kind, out_features=weight.shape[0],
                          in_features=weight.shape[1])

    with torch.no_grad():
        for module in ref.modules():
            if isinstance(module, TrainableRowsEmbedding):
                module.merge()
            if isinstance(module, LoRALinear):
                a, b = (t.view(torch.float16).float()
                        for t in woq.pack_correction(module.lora_A, module.lora_B.T * module.scaling))
                module.lora_A.copy_(a)
                module.lora_B.copy_(b.T / module.scaling)
        head = nn.Linear(ref.lm_head.in_features, ref.lm_head.out_features, bias=False)
        head.weight = nn.Parameter(rounded(ref.lm_head.weight, default_head(quant)))
        ref.lm_head = head
        # a shared expert's gate without an adapter keeps fp32, as the router does (quantize)
        kept = {m.shared_expert_gate for m in ref.modules() if isinstance(m, SparseMoE)}
        for module in ref.modules():
            if type(module) is LoRALinear or (type(module) is nn.Linear and module is not head
                                              and module not in kept):
                module.weight = nn.Parameter(rounded(module.weight, quant))
            if isinstance(module, Experts):  # packed per expert
                for param in (module.gate_up_proj, module.down_proj):
                    param.copy_(torch.stack([rounded(w, quant) for w in param]))
    return ref


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("preset,tied", [("clover-tiny", False), ("clover-tiny-dense", True)])
@torch.no_grad()
def test_adapter_is_kept_beside_the_quantised_base(preset, tied, quant, monkeypatch):
    dequantised_matmul(monkeypatch)  # what is tested is the packing and the correction
    adapted = _adapted(preset, tie_word_embeddings=tied)
    ref = _adapted_reference(adapted, quant)
    model = quantize(copy.deepcopy(adapted), quant)
    assert not has_lora(model) and not any(isinstance(m, TrainableRowsEmbedding) for m in model.modules())
    assert model.lm_head.kind == default_head(quant)
    ranks, last = model.quantization["low_rank"], f"model.layers.{model.config.num_hidden_layers - 1}"
    assert ranks[f"{last}.self_attn.qkv_proj"] == 12 and ranks[f"{last}.self_attn.o_proj"] == 4  # q, k, v: 3 x 4
    mlp = f"{last}.mlp" + (".shared_expert" if preset == "clover-tiny" else "")
    assert ranks[f"{mlp}.gate_up_proj"] == 8 and ranks[f"{mlp}.down_proj"] == 4
    ids, q = torch.randint(0, 250, (2, 21)), torch.tensor([[255, 255, 7, 255] * 2] * 2)  # two query blocks
    for got, want in ((model(ids).logits, ref(ids).logits),
                      (model(ids, block_size=4, prefix_len=5, query_ids=q).query_logits,
                       ref(ids, block_size=4, prefix_len=5, query_ids=q).query_logits)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # the adapter matters: the quantised base alone is far off
    base = quantize(copy.deepcopy(tiny_model(preset, tie_word_embeddings=tied)), quant)(ids).logits
    assert (base - ref(ids).logits).abs().max() > 100 * 1e-5 * ref(ids).logits.abs().max()


def _dense_reference(model: CloverForBlockDiffusion) -> CloverForBlockDiffusion:
    """The quantised model with each packed layer replaced by an nn.Linear of its dequantised weights (packed
    experts by `Experts` of theirs)."""
    ref = copy.deepcopy(model)
    for name, module in list(ref.named_modules()):
        owner, _, attr = name.rpartition(".")
        if isinstance(module, PackedLinear):
            dense = nn.Linear(module.in_features, module.out_features, bias=False)
            dense.weight = nn.Parameter(module.dequantized())
            setattr(ref.get_submodule(owner), attr, dense)
        elif isinstance(module, PackedExperts):
            experts = Experts(ref.config)
            experts.gate_up_proj = nn.Parameter(module.dequantized("gate_up"))
            experts.down_proj = nn.Parameter(module.dequantized("down"))
            setattr(ref.get_submodule(owner), attr, experts)
    for module in ref.modules():
        if hasattr(module, "fused_step"):
            module.fused_step = False  # the DeltaNet step's modules
    for layer in ref.model.layers:
        layer.fused = False  # torch's modules now
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
@pytest.mark.parametrize("activations,shrink", [("int8", 1), ("int8x2", 250)])
@pytest.mark.parametrize("preset,rms", [("clover-tiny", 0.05), ("clover-tiny-dense", 0.015)])
@torch.no_grad()
def test_quantised_model_stays_close_to_its_dequantised_reference(preset, quant, rms, activations, shrink):
    """int8 / int4 layers also round their input to int8 per group: each adds a relative error of rms about
    (max|x| / rms|x|) / (127 sqrt(12)), ~0.5 % for a group of 32 normal values, which compounds over the layers
    (measured on the logits: 0.7 % for the dense preset, 2-2.4 % for the hybrid one, whose random DeltaNet
    layers and peaked head amplify it). Bounds: 2x those; and the next-token choices stay the reference's.
    Two passes (int8x2) round the residual again, ~254x less per layer (measured: 2.6e-5 and 5.4e-5 of the
    logits' rms, 270-440x less): bounds 250x smaller."""
    model = quantize(tiny_model(preset), quant, activations=activations)
    ref = _dense_reference(model)
    ids = torch.randint(0, 250, (2, 30))
    got, want = model(ids).logits, ref(ids).logits
    assert (got - want).pow(2).mean().sqrt() < rms / shrink * want.pow(2).mean().sqrt()
    # the hybrid's experts round their inputs too, and its random router and peaked head have near ties: int4 with
    # one pass keeps 91.7 % of the argmax tokens (55 of 60) at the same 2.2 % rms error
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= (0.9 if preset == "clover-tiny" else 0.95)


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
    forwards agree as the unquantised model's do (1e-4), except where an fp32-rounding difference upstream moves
    an activation across a rounding boundary of its int8 grid (`assert_close_up_to_activation_rounding`): the
    hybrid's DeltaNet runs chunked uncached and recurrent cached; the dense model's fused layers
    (clover.model.fused) compute attention by loops up to 32 rows and by SDPA beyond. Up to 32 rows, a dense
    model's cached and uncached rows see the same inputs to fp32 rounding."""
    model = quantize(tiny_model(preset), quant)
    ids = torch.randint(0, 250, (2, 40))
    for length in (40, 30):
        full = model(ids[:, :length]).logits
        cache = model.new_cache(2)
        pieces = [model(ids[:, :20], cache=cache).logits]
        pieces += [model(ids[:, t : t + 1], cache=cache).logits for t in range(20, length)]
        got = torch.cat(pieces, 1)
        # the hybrid's MoE layers round each token's input (and its experts' hidden rows) to int8 twice more per
        # layer, where an fp32 difference upstream (chunked against recurrent DeltaNet) can cross a boundary: 85 % of
        # its logits agree to 1e-4
        assert_close_up_to_activation_rounding(got, full, close_share=0.9 if preset == "clover-tiny-dense" else 0.8)
        if preset == "clover-tiny-dense" and length <= 32:
            torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4 * full.abs().max().item())


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "int4"])
def test_kernel_output_does_not_depend_on_the_thread_count(kind):
    """Every output block and every correction dot is computed whole by one thread of the call's team: 1, 2 or 3
    threads give the same bits."""
    torch.manual_seed(0)
    packed = woq.pack(torch.randn(600, 128), kind)
    correction = woq.pack_correction(torch.randn(8, 128), torch.randn(8, 600))
    args = {**packed, "kind": kind, "out_features": 600, "correction": correction}
    x = torch.randn(5, 128)
    threads = torch.get_num_threads()
    try:
        outputs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outputs.append(woq.woq_linear(x, **args))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outputs[0]) for out in outputs[1:])


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("activations", ["int8", "int8x2"])
def test_integer_kernel_rows_do_not_depend_on_the_block(kind, activations):
    """Each row is quantised and accumulated alone, in a fixed order: the same bits alone or in any block."""
    torch.manual_seed(0)
    packed = woq.pack(torch.randn(40, 128), kind)
    x = torch.randn(17, 128)
    args = {**packed, "kind": kind, "out_features": 40, "activations": activations}
    block = woq.woq_linear(x, **args)
    for r in (0, 5, 16):
        assert torch.equal(woq.woq_linear(x[r : r + 1], **args), block[r : r + 1])


_TILE_OUTPUTS = """
import sys, torch
from safetensors.torch import save_file
from clover.ops import woq
torch.manual_seed(0)
out = {}
for kind in ("int8", "int4"):
    packed = woq.pack(torch.randn(40, 128), kind)  # a partial 16-column block
    correction = woq.pack_correction(torch.randn(4, 128), torch.randn(4, 40))
    for rows in (1, 3, 4, 7, 8, 12, 16, 17, 31, 40):  # every tile height, and remainders
        x = torch.randn(rows, 128)
        for activations in ("int8", "int8x2"):
            out[f"{kind}-{rows}-{activations}"] = woq.woq_linear(x, **packed, kind=kind, out_features=40,
                                                                 activations=activations, correction=correction)
save_file(out, sys.argv[1])
print(woq.has_vnni())
"""


def test_the_avx512_vnni_tiles_give_the_avx2_tiles_bits(tmp_path):
    """Where the CPU has AVX512-VNNI the int8 / int4 tiles run on it (16 columns a register, vpdpbusd); their int32
    dots and fp32 epilogue are the AVX2 tiles', so the outputs are bit for bit the same (`CLOVER_WOQ_VNNI=0`, read
    once per process, keeps a process on AVX2's)."""
    if not woq.has_vnni():
        pytest.skip("this CPU has no AVX512-VNNI: only the AVX2 tiles run here")
    outputs = {}
    for vnni in ("1", "0"):
        path = tmp_path / f"vnni{vnni}.safetensors"
        run = subprocess.run([sys.executable, "-c", _TILE_OUTPUTS, str(path)], capture_output=True, text=True,
                             env={**os.environ, "CLOVER_WOQ_VNNI": vnni}, check=True)
        assert run.stdout.split()[-1] == str(vnni == "1")
        outputs[vnni] = load_file(path)
    assert outputs["1"].keys() == outputs["0"].keys()
    for key, got in outputs["1"].items():
        assert torch.equal(got, outputs["0"][key]), key


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


@torch.no_grad()
def test_kernel_reads_only_the_rows_of_a_fused_correction_that_are_not_zero():
    """A fused projection's B' is block-diagonal (one block of rows per adapted part, all-zero rows of an untrained
    adapter left out): `tile_correction` keeps, per block of 16 outputs, only the rows not zero there; the kernel
    reading those computes what the whole of B' computes, and an index pointing outside A or the tiles is refused."""
    model = _adapted("clover-tiny-dense")
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.lora_B.zero_()  # an adapter that has not moved: nothing to read
    model = quantize(model, "int4")
    qkv = model.model.layers[0].self_attn.qkv_proj
    q_blocks, kv_blocks = model.config.num_attention_heads, model.config.num_key_value_heads  # head_dim 16
    index = qkv.correction_index.tolist()
    assert [i[:2] for i in index] == [[0, 4]] * q_blocks + [[0, 0]] * kv_blocks + [[8, 4]] * kv_blocks
    assert [i[2] for i in index] == [sum(i[1] for i in index[:b]) for b in range(len(index))]  # one after another
    assert qkv.correction_tiles.shape == (4 * (q_blocks + kv_blocks), 16)
    assert qkv.weight_bytes() == sum(t.numel() * t.element_size() for t in (qkv.qweight, qkv.scale, qkv.zero)) + \
        2 * (qkv.correction_a.numel() + 16 * 4 * (q_blocks + kv_blocks))  # fp16
    args = {"qweight": qkv.qweight, "scale": qkv.scale, "zero": qkv.zero, "kind": "int4",
            "out_features": qkv.out_features, "correction": (qkv.correction_a, qkv.correction_b),
            "activations": "int8x2"}
    x = torch.randn(3, 64)
    got = woq.woq_linear(x, **args, correction_tiles=(qkv.correction_tiles, qkv.correction_index))
    # every row of B' in every block (zero rows add exact zeros): the same outputs, bit for bit
    blocks = qkv.correction_b.view(torch.float16).T.reshape(-1, 16, qkv.rank).transpose(1, 2)
    dense = (blocks.reshape(-1, 16).contiguous().view(torch.int16),
             torch.tensor([[0, qkv.rank, b * qkv.rank] for b in range(len(blocks))]))
    assert torch.equal(got, woq.woq_linear(x, **args, correction_tiles=dense))
    want = woq.reference_linear(x, **{k: v for k, v in args.items() if k != "activations"})
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    for bad in ([1, qkv.rank, 0], [0, 4, len(qkv.correction_tiles) - 3]):  # past A's rows; past the tiles
        index = qkv.correction_index.clone()
        index[0] = torch.tensor(bad)
        with pytest.raises(RuntimeError, match="index points outside"):
            woq.woq_linear(x, **args, correction_tiles=(qkv.correction_tiles, index))


@pytest.mark.parametrize("quant", ["int8", "int4"])
@torch.no_grad()
def test_quantised_adapted_checkpoint_saves_and_loads(tmp_path, quant):
    model = quantize(_adapted("clover-tiny-dense"), quant)
    model.save_pretrained(tmp_path / "q")
    assert not (tmp_path / "q" / "adapter_config.json").exists()  # the adapter lives in the packed layers
    spec = json.loads((tmp_path / "q" / "quantization.json").read_text())
    assert spec["lm_head"] == default_head(quant) and spec["low_rank"]["model.layers.0.mlp.gate_up_proj"] == 8
    loaded = CloverForBlockDiffusion.from_pretrained(tmp_path / "q")
    assert loaded.quantization == model.quantization and loaded.model.layers[0].mlp.gate_up_proj.rank == 8
    for name, layer in model.named_modules():  # B' is tiled for the kernel again on loading
        if isinstance(layer, PackedLinear) and layer.rank:
            assert torch.equal(loaded.get_submodule(name).correction_tiles, layer.correction_tiles)
            assert torch.equal(loaded.get_submodule(name).correction_index, layer.correction_index)
    ids = torch.randint(0, 250, (1, 12))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    cast = CloverForBlockDiffusion.from_pretrained(tmp_path / "q", dtype=torch.bfloat16)
    assert all(torch.equal(cast.state_dict()[n], t) for n, t in model.state_dict().items() if "correction" in n)
    assert cast(ids).logits.dtype == torch.bfloat16  # bf16 activations through the fp16 correction
    assert quantize(loaded, quant) is loaded  # a checkpoint stored in the asked format is used as it is

    spec["low_rank"]["model.layers.9.mlp.down_proj"] = 4
    (tmp_path / "q" / "quantization.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="low_rank names layers the model does not have"):
        CloverForBlockDiffusion.from_pretrained(tmp_path / "q")


@torch.no_grad()
def test_activation_rounding_is_recorded(tmp_path):
    """`quantize` records how int8 / int4 layers round their input (default: two passes for int8, one for int4);
    a checkpoint restores it; one from before the choice existed (no "activations") loads with the one-pass
    rounding it was computed with; an unknown one is refused; a model in the asked format switches it without
    re-quantising."""

    def rounding(m: nn.Module) -> set[str]:
        return {layer.activations for layer in m.modules() if isinstance(layer, PackedLinear)}

    assert (default_activations("int8"), default_activations("int4")) == ("int8x2", "int8")
    for quant in ("int8", "int4"):
        default = quantize(tiny_model("clover-tiny-dense"), quant)
        assert default.quantization["activations"] == default_activations(quant)
        assert rounding(default) == {default_activations(quant)}
    model = quantize(tiny_model("clover-tiny-dense"), "int4", activations="int8x2")
    one = quantize(tiny_model("clover-tiny-dense"), "int4", activations="int8")
    ids = torch.randint(0, 250, (1, 12))
    assert rounding(model) == {"int8x2"} and rounding(one) == {"int8"}
    assert not torch.equal(one(ids).logits, model(ids).logits)
    one.save_pretrained(tmp_path / "q")
    spec_path = tmp_path / "q" / "quantization.json"
    spec = json.loads(spec_path.read_text())
    assert spec["activations"] == "int8"
    loaded = CloverForBlockDiffusion.from_pretrained(tmp_path / "q")
    assert loaded.quantization == one.quantization and rounding(loaded) == {"int8"}
    assert torch.equal(loaded(ids).logits, one(ids).logits)
    assert quantize(loaded, "int4", activations="int8x2") is loaded and rounding(loaded) == {"int8x2"}
    assert loaded.quantization["activations"] == "int8x2" and torch.equal(loaded(ids).logits, model(ids).logits)

    spec_path.write_text(json.dumps({k: v for k, v in spec.items() if k != "activations"}))
    old = CloverForBlockDiffusion.from_pretrained(tmp_path / "q")
    assert rounding(old) == {"int8"} and old.quantization["activations"] == "int8"
    assert torch.equal(old(ids).logits, one(ids).logits)
    spec_path.write_text(json.dumps(spec | {"activations": "int16"}))
    with pytest.raises(ValueError, match="quantization.json: unknown activation rounding 'int16'"):
        CloverForBlockDiffusion.from_pretrained(tmp_path / "q")
    with pytest.raises(ValueError, match=r"unknown activation rounding 'int16': expected one of \['int8', 'int8x2'\]"):
        quantize(tiny_model("clover-tiny-dense"), "int4", activations="int16")
    with pytest.raises(ValueError, match="unknown activation rounding 'fp8'"):
        woq.woq_linear(torch.randn(1, 64), **woq.pack(torch.randn(16, 64), "int8"), kind="int8", out_features=16,
                       activations="fp8")


@torch.no_grad()
def test_lm_head_format(tmp_path):
    """int4 keeps the head at int8 unless told; the checkpoint records the head's format (missing: refused)."""
    assert isinstance(quantize(tiny_model("clover-tiny-dense"), "int8").lm_head, PackedLinear)
    model = quantize(tiny_model("clover-tiny-dense"), "int4", head="int4")
    assert model.lm_head.kind == "int4" and model.model.layers[0].mlp.down_proj.kind == "int4"
    model.save_pretrained(tmp_path / "q")
    spec = json.loads((tmp_path / "q" / "quantization.json").read_text())
    loaded = CloverForBlockDiffusion.from_pretrained(tmp_path / "q")
    ids = torch.randint(0, 250, (1, 12))
    assert loaded.lm_head.kind == "int4" and torch.equal(loaded(ids).logits, model(ids).logits)
    del spec["lm_head"]
    (tmp_path / "q" / "quantization.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="unknown lm_head format None"):
        CloverForBlockDiffusion.from_pretrained(tmp_path / "q")
    with pytest.raises(ValueError, match="unknown LM head format 'int2'"):
        quantize(tiny_model("clover-tiny-dense"), "int4", head="int2")


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
    quantize(model, "int8")
    with pytest.raises(ValueError, match="already quantised"):
        quantize(model, "int4")
    with pytest.raises(ValueError, match="already quantised"):
        quantize(model, "int8", head="int4")


def test_none_leaves_the_model_alone():
    model = tiny_model("clover-tiny-dense")
    assert quantize(model, "none") is model and isinstance(model.lm_head, nn.Linear)


@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("shape", [(48, 64), (40, 96)])  # out features a multiple of 16, and not
def test_packed_shapes_are_what_pack_returns(kind, shape):
    """Empty packed modules are laid out from `packed_shapes` (no packing on the meta device): it must describe
    exactly the tensors `pack` makes."""
    packed = woq.pack(torch.randn(*shape), kind, 32)
    assert woq.packed_shapes(*shape, kind, 32) == {name: (tuple(t.shape), t.dtype) for name, t in packed.items()}
