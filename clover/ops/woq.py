"""Weight-only quantised (and packed) linear layers for CPU forwards over a few rows.

A decoding step of a small model on a CPU reads every weight once for a handful of rows (one token, or a block
of them): the cost is the bytes read, if the kernel reads each weight once whatever the row count. torch's own
paths do not, on an AVX2 machine: its bf16 matmul and `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu`
grow linearly with the rows (docs/cpu.md has the measurements). `csrc/woq.cpp` does: it streams the weights in
blocks of 16 output columns and runs every row over each block while it is in registers or L1.

Formats (weight `W [O, K]`; `q` the stored integers):

* `fp32`, `bf16`: the weights as they are, only re-laid out (`bf16` halves the bytes of `fp32`).
* `int8`: symmetric per group `g` of `group_size` consecutive k of an output column (llama.cpp's Q8_0):
  `W[o, k] ~= s[o, g] * q[o, k]`, `q` in [-127, 127], `s = max |W| / 127` over the group, fp16:
  1 + 2 / group_size bytes per weight (1.06 at the default 32).
* `int4`: asymmetric per group (llama.cpp's Q4_1): `W[o, k] ~= s[o, g] * q[o, k] + m[o, g]`, `q` in [0, 15],
  `m` the group's minimum, `s = (max - m) / 15`, both fp16: 0.5 + 4 / group_size bytes per weight (0.625 at the
  default 32). The group size of both is a multiple of 8.

int8 / int4 compute with integer dot products (as llama.cpp's CPU kernels do): each row of `x` is quantised per
group to int8, `sx = max |x| / 127`, `qx = round(x / sx)`; then `y[o] = sum_g s[o, g] sx[g] (q . qx)_g` (int4:
`+ m[o, g] sx[g] sum(qx)_g`), the dot products exact in int32. So the result is not the dequantised weights times
`x` exactly: rounding `x` adds an error of at most `sx / 2` per element, of rms `max |x| / (127 sqrt(12))`
(uniform over a step), which averages down over a dot product (the tests bound it).

`activations` chooses how many int8 passes round `x` (`ACTIVATIONS`): `"int8"` the one above; `"int8x2"` also
rounds the residual, per group `s1 = max |x| / 127`, `q1 = round(x / s1)`, `r = x - s1 q1` (one fp32 rounding,
`|r| <= s1 / 2`), at the fixed step `s2 = s1 / 254`, `q2 = round(r / s2)`: `x ~ s2 Q` with the integer code
`Q = 254 q1 + q2`, and `y[o] = sum_g s[o, g] s2_g (q . Q)_g` (int4: `+ m[o, g] s2_g sum(Q)_g`), the dot product
`254 (q . q1) + (q . q2)` exact in int32. The error per element is at most `s2 / 2 = s1 / 508`, 254x smaller,
for up to twice the integer work (the second pass runs as a second row of codes over the same decoded weights:
twice the time from a few rows on, less at one row, where the weights' streaming hides part of it) and the same
fp32 epilogue as one pass.

Every packed tensor is stored with an integer dtype (fp32 as int32 bits, bf16 / fp16 as int16 bits), so a
model-wide `.to(dtype)` never rounds them.

Packed layout, version `LAYOUT_VERSION` (`pack`, `pack_codes`): output columns padded to a multiple of 16.
fp32 / bf16 element `(o, k)` at `[o // 16, k, o % 16]`. int8 at `[o // 16, k // 4, o % 16, k % 4]`: a 32-byte
load is 8 columns x 4 consecutive k, what AVX2's `maddubs` multiplies by 4 codes of `x` (one int32 broadcast).
int4 two codes a byte, `[o // 16, k // 8, o % 16, k % 4]`, `k % 8 < 4` in the low nibble and `k + 4` in the
high one (a mask and a shift give the two 8 x 4 halves). Scales and minima as `[O/16, K/g, 16]`.
`unpack_codes` inverts it to the logical codes, `unpack` to dense fp32 weights: `reference_linear` (dequantise,
then `F.linear`) is what runs where the extension cannot (another device), and the tests' yardstick.

The extension is compiled on first use (`torch.utils.cpp_extension`, a C++ compiler required) into
`$CLOVER_CACHE/extensions/` and reused by later processes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from clover.paths import cache_root

logger = logging.getLogger(__name__)

KINDS = {"fp32": 0, "bf16": 1, "int8": 2, "int4": 3}
BLOCK = 16  # output columns per packed block (the kernel's register tile is 16 wide)
TILE_K = 256  # K per chunk of the fp32 path (and of the portable path's decoded bf16): 256 x 16 fp32 = 16 KiB, in L1
LAYOUT_VERSION = 4  # of the packed layout; 1: int8 / int4 codes as [o // 16, k, o % 16] (fp32 decoding kernels);
# 2: low-rank corrections in fp32; 3: a MoE's routed experts kept in fp32 and its shared expert's gate packed (4 packs
# the experts, stacked: clover.model.quant.PackedExperts, and keeps that [1, H] gate in fp32, as the router)
DEFAULT_GROUP_SIZE = 32  # llama.cpp's Q4_1/Q8_0 block, the format clover-smol's base weights come in
ACTIVATIONS = {"int8": 1, "int8x2": 2}  # int8 / int4 layers' rounding of x: int8 passes (the kernel's `passes`)
# From this many rows a forward's layers run as modules, not as the fused C++ layer (clover.model.fused), whose gain is
# dispatch, which many rows amortise
DENSE_ROWS = 256
# `reference_linear` pads its rows to a multiple of this: BLAS picks its kernel by the row count, and MKL's fp32
# kernels for a few rows can give a row other bits than a larger product does. Padded, a row's bits do not depend
# on how many rows share its forward (tests/model/test_quant.py): exact mode's first forward (a prompt's last chunk
# and query rows) multiplies the prompt's rows as block size 1's.
ROW_TILE = 16
CSRC = Path(__file__).parent / "csrc"
# the kernels; a decoder layer built on them (clover.model.fused); a sparse MoE layer grouped by expert
# (clover.model.quant.PackedExperts); a Gated DeltaNet decoding step (clover.model.deltanet)
SOURCES = (CSRC / "woq.cpp", CSRC / "layer.cpp", CSRC / "moe.cpp", CSRC / "deltanet.cpp")
HEADERS = (CSRC / "woq.h",)
# No -march: the AVX2 path is selected per function and at run time, so the build stays portable. -fopenmp: the
# kernel's own thread team is an OpenMP region, and ATen's at::parallel_for (the layer's attention) is a header
# template that runs on OpenMP threads only where the including code is compiled with it (otherwise serially); the
# runtime is torch's own libgomp, so torch.set_num_threads sets the kernels' threads.
FLAGS = ["-O3", "-fopenmp"]

BUILT_STAMP = "built"  # written beside a compiled library once it has loaded
_extension: Any = None


def extension() -> Any:
    """The compiled kernel module (built once per source and torch version, then loaded from the cache)."""
    global _extension
    if _extension is None:
        _extension = compile_kernels(SOURCES, kernel_tag())
    return _extension


def compile_kernels(sources: tuple[Path, ...], tag: str) -> Any:
    """The kernels of `sources` (woq.cpp, layer.cpp and the header beside them) as an extension module named by
    `tag`, compiled into `$CLOVER_CACHE/extensions/woq-<tag>` on first use and loaded from there after
    (`benchmarks/bench_kernel_ab.py` builds another revision's sources this way)."""
    name = f"clover_woq_{tag}"
    build = cache_root() / "extensions" / f"woq-{tag}"
    built = build / f"{name}.so"
    if (build / BUILT_STAMP).is_file():  # built and loaded before: import the library (ninja's check is slow)
        spec = importlib.util.spec_from_file_location(name, built)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    from torch.utils import cpp_extension  # deferred: costly on every model import, for a first build only

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"clover's quantised CPU kernels are compiled on first use and need a C++ compiler, "
                           f"but {compiler!r} was not found: install one (e.g. `apt-get install g++`) or set CXX")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("clover's quantised CPU kernels are compiled on first use with ninja, which was not "
                           "found: pip install ninja")
    build.mkdir(parents=True, exist_ok=True)
    logger.info("loading the weight-only-quantisation kernel from %s (compiled there on first use)", build)
    module = cpp_extension.load(name=name, sources=[str(path) for path in sources], build_directory=str(build),
                                extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], verbose=False)
    (build / BUILT_STAMP).touch()  # the library is whole: `tag` names its sources, flags and torch
    return module


def kernel_tag() -> str:
    """What the compiled kernels are: their sources, flags and torch version (the build's name; a forward's cost
    depends on it, clover.engine.drafts.cost)."""
    source = "".join(path.read_text() for path in SOURCES + HEADERS)
    return hashlib.sha256(f"{source}|{FLAGS}|{torch.__version__}".encode()).hexdigest()[:12]


def check_activations(activations: str) -> None:
    if activations not in ACTIVATIONS:
        raise ValueError(f"unknown activation rounding {activations!r}: expected one of {list(ACTIVATIONS)}")


def check(kind: str, in_features: int, group_size: int, name: str = "weight") -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown weight format {kind!r}: expected one of {list(KINDS)}")
    if in_features % 8:
        raise ValueError(f"cannot pack {name}: its input dimension {in_features} is not a multiple of 8")
    if kind in ("int8", "int4"):
        if group_size <= 0 or group_size % 8:
            raise ValueError(f"{kind} group_size must be a positive multiple of 8, got {group_size}")
        if in_features % group_size:
            raise ValueError(f"{kind} with group_size {group_size} cannot quantise {name}: its input dimension "
                             f"{in_features} is not a multiple of {group_size}")


def quantize_groups(weight: torch.Tensor, kind: str,
                    group_size: int = DEFAULT_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest on the format's grid, in the logical layout: `W [O, K]` -> codes `q [O, K]` (int8, or
    uint8 in [0, 15] for int4), fp16 `scale [O, K / g]` and (int4) fp16 minimum `zero [O, K / g]`.

    The fp16-rounded scale and minimum are the ones dequantisation uses, so codes are rounded against them.
    A calibrated quantiser would choose its own codes on the same grid and pack them with `pack_codes`."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().view(out_features, in_features // group_size, group_size)
    tiny = torch.finfo(torch.float16).tiny
    if kind == "int8":
        scale = (groups.abs().amax(dim=2) / 127).half()
        q = torch.round(groups / scale.float().clamp(min=tiny)[..., None]).clamp(-127, 127)
        return q.to(torch.int8).view(out_features, in_features), scale, None
    low = groups.amin(dim=2).half()
    scale = ((groups.amax(dim=2) - low.float()) / 15).half()
    q = torch.round((groups - low.float()[..., None]) / scale.float().clamp(min=tiny)[..., None]).clamp(0, 15)
    return q.to(torch.uint8).view(out_features, in_features), scale, low


def pack(weight: torch.Tensor, kind: str, group_size: int = DEFAULT_GROUP_SIZE,
         name: str = "weight") -> dict[str, torch.Tensor]:
    """`W [O, K]` -> `{"qweight", "scale", "zero"}` in the packed layout (module docstring); int8 / int4 are
    rounded to nearest (`quantize_groups`)."""
    check(kind, weight.shape[1], group_size, name)
    w = weight.detach().float()
    if kind in ("int8", "int4"):
        return pack_codes(*quantize_groups(w, kind, group_size), kind)
    blocks = _blocked_rows(w)  # [O/16, K, 16]
    if kind == "fp32":
        return {"qweight": blocks.view(torch.int32), "scale": w.new_zeros(0), "zero": w.new_zeros(0)}
    # bf16 is stored as int16 bits, so a model-wide `.to(dtype)` leaves it alone
    return {"qweight": blocks.to(torch.bfloat16).view(torch.int16), "scale": w.new_zeros(0), "zero": w.new_zeros(0)}


def packed_shapes(out_features: int, in_features: int, kind: str,
                  group_size: int = DEFAULT_GROUP_SIZE) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The shape and dtype of each tensor `pack` returns for `[out_features, in_features]` weights, computed
    without packing (packing a meta tensor runs `torch._refs`, whose first call imports `torch._dynamo`: seconds
    of a model's load)."""
    check(kind, in_features, group_size)
    blocks, none = -(-out_features // BLOCK), ((0,), torch.float32)
    if kind in ("fp32", "bf16"):
        return {"qweight": ((blocks, in_features, BLOCK), torch.int32 if kind == "fp32" else torch.int16),
                "scale": none, "zero": none}
    scale = ((blocks, in_features // group_size, BLOCK), torch.int16)
    if kind == "int8":
        return {"qweight": ((blocks, in_features // 4, BLOCK, 4), torch.int8), "scale": scale,
                "zero": ((0,), torch.float16)}
    return {"qweight": ((blocks, in_features // 8, BLOCK, 4), torch.uint8), "scale": scale, "zero": scale}


def pack_codes(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, kind: str) -> dict[str, torch.Tensor]:
    """Logical codes and fp16 scales / minima (`quantize_groups`' output) -> the packed layout."""
    in_features = q.shape[1]
    check(kind, in_features, in_features // scale.shape[1], "codes")
    blocks = _padded(q).view(-1, BLOCK, in_features // 8, 2, 4).transpose(1, 2)  # [O/16, K/8, 16, 2, 4]
    scales = {"scale": _blocked_rows(scale).view(torch.int16)}
    if kind == "int8":
        return {"qweight": blocks.transpose(2, 3).reshape(-1, in_features // 4, BLOCK, 4).contiguous(), **scales,
                "zero": scale.new_zeros(0)}
    return {"qweight": (blocks[:, :, :, 0] | (blocks[:, :, :, 1] << 4)).contiguous(), **scales,
            "zero": _blocked_rows(zero).view(torch.int16)}


def _padded(t: torch.Tensor) -> torch.Tensor:
    """Output rows zero-padded to a multiple of 16."""
    pad = -t.shape[0] % BLOCK
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def _blocked_rows(t: torch.Tensor) -> torch.Tensor:
    """`[O, C]` -> `[ceil(O / 16), C, 16]`, output rows zero-padded to a multiple of 16."""
    t = _padded(t)
    return t.view(t.shape[0] // BLOCK, BLOCK, -1).transpose(1, 2).contiguous()


def _unblocked(t: torch.Tensor, out_features: int) -> torch.Tensor:
    """`[Opad/16, C, 16]` -> `[O, C]` (inverts `_blocked_rows`)."""
    return t.transpose(1, 2).reshape(-1, t.shape[1])[:out_features]


def unpack_codes(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, kind: str, out_features: int,
                 in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """int8 / int4 packed tensors -> the logical codes `q [O, K]`, fp16 `scale [O, K/g]` and (int4) `zero`:
    the inverse of `pack_codes`."""
    if kind == "int8":
        q = qweight.view(-1, in_features // 8, 2, BLOCK, 4).transpose(2, 3)  # [O/16, K/8, 16, 2, 4]
    else:
        q = torch.stack([qweight & 15, qweight >> 4], dim=3)
    q = q.transpose(1, 2).reshape(-1, in_features)[:out_features]
    scale = _unblocked(scale.view(torch.float16), out_features)
    return q, scale, _unblocked(zero.view(torch.float16), out_features) if kind == "int4" else None


def unpack(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, kind: str, out_features: int,
           in_features: int, group_size: int = DEFAULT_GROUP_SIZE) -> torch.Tensor:
    """The dense fp32 `[O, K]` weights a packed one stands for (dequantised)."""
    check(kind, in_features, group_size)
    if kind == "fp32":
        return _unblocked(qweight.view(torch.float32), out_features)
    if kind == "bf16":
        return _unblocked(qweight.view(torch.bfloat16), out_features).float()
    q, s, m = unpack_codes(qweight, scale, zero, kind, out_features, in_features)
    w = q.float().view(out_features, -1, group_size) * s.float()[..., None]
    if m is not None:
        w = w + m.float()[..., None]
    return w.view(out_features, in_features)


def dequantize(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, kind: str, out_features: int,
               in_features: int, group_size: int = DEFAULT_GROUP_SIZE, vectorised: bool = True) -> torch.Tensor:
    """`unpack` of int8 / int4 weights by the extension (the same values, one C++ pass: for a forward of many rows
    on a CPU, where `unpack`'s tensor ops cost more than the matmul they feed gains); `vectorised=False` takes the
    portable loops where the CPU has AVX2."""
    check(kind, in_features, group_size)
    return extension().dequantize(qweight, scale, zero, KINDS[kind], out_features, in_features, group_size,
                                  vectorised)


def reference_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, kind: str,
                     out_features: int, group_size: int = DEFAULT_GROUP_SIZE,
                     correction: tuple[torch.Tensor, torch.Tensor] | None = None,
                     gate: tuple[int, int] | None = None, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantise, then an fp32 matmul: `x [..., K]` -> `[..., O]` in x's dtype; `correction`: `(A [r, K],
    B' [r, O])`, fp16 stored as int16 bits (`pack_correction`), adds `(x A^T) B'` (a low-rank term kept beside
    the packed weights); `gate` `(T, start)`: a gated adapter's correction, added only where a row's position
    in its sequence of `T` tokens (the rows of `x` in order) is `>= start` (its query stream). `weight`: the
    dequantised weights when the caller has them (`dequantize`). A row's result has the same bits however many
    rows share the call (`ROW_TILE`)."""
    w = weight if weight is not None else unpack(qweight, scale, zero, kind, out_features, x.shape[-1], group_size)
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    tiles = _row_tiles(rows.float())
    y = F.linear(tiles, w.to(x.device))[:n]
    if correction is not None:
        a, b = (t.view(torch.float16).float() for t in correction)
        period, start = gate or (1, 0)
        if start < period:  # rows of the query stream (every row without a gate); a prefill chunk has none
            correction_rows = (F.linear(tiles, a) @ b)[:n].view(-1, period, out_features)
            y.view(-1, period, out_features)[:, start:] += correction_rows[:, start:]
    return y.view(*x.shape[:-1], out_features).to(x.dtype)


def _row_tiles(rows: torch.Tensor) -> torch.Tensor:
    """`rows` `[n, K]` padded with zero rows to a multiple of `ROW_TILE` (as they are when they fill whole tiles)."""
    n = rows.shape[0]
    if n % ROW_TILE == 0:
        return rows
    out = rows.new_zeros(n - n % ROW_TILE + ROW_TILE, rows.shape[1])
    out[:n] = rows
    return out


def pack_correction(a: torch.Tensor, b: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """A low-rank correction `(A [r, K], B' [r, O])` (any float dtype) -> fp16, stored as int16 bits: half the
    bytes of fp32 for an error the logits barely see (clover-smol's int4 build with it answers every held-out prompt
    as the fp32 model does: docs/cpu.md). Each rank's row of A and of B' is first rescaled, `A_i c_i`
    and `B'_i / c_i` with `c_i = sqrt(max |B'_i| / max |A_i|)`, which leaves `(x A^T) B'` as it is and gives both
    the same largest magnitude, so neither falls to fp16's subnormals (below 6.1e-5) where a small adapter's B'
    would lose its digits."""
    a, b = a.detach().float(), b.detach().float()
    peak_a, peak_b = a.abs().amax(dim=1, keepdim=True), b.abs().amax(dim=1, keepdim=True)
    c = torch.where((peak_a > 0) & (peak_b > 0), (peak_b / peak_a.clamp(min=1e-30)).sqrt(), torch.ones_like(peak_a))
    a, b = (a * c).half(), (b / c).half()
    if not (a.isfinite().all() and b.isfinite().all()):
        raise ValueError(f"{name}: the low-rank correction does not fit fp16 (a product of A's and B's magnitudes "
                         f"past 65504^2, or a value that is not finite)")
    return a.contiguous().view(torch.int16), b.contiguous().view(torch.int16)


def tile_correction(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A correction's `B' [r, O]` (fp16, or its int16 bits) as the kernel reads it, block by block of 16 output
    columns with the block's own outputs: per block, the span of rows of B' that are not all zero over its columns,
    those rows' 16 columns one after another in `tiles [n, 16]` (fp16 as int16 bits, zero-padded past O), and
    `index [ceil(O / 16), 3]` int64: (first row, rows, first tile row). A fused projection's B' is block-diagonal
    (one block of rows per adapted part), and an adapter that has not moved a part has zero rows: none of that is
    stored or read."""
    b = b.view(torch.float16) if b.dtype == torch.int16 else b.half()
    rank, out_features = b.shape
    if rank == 0:
        return torch.zeros(0, BLOCK, dtype=torch.int16), torch.zeros(-(-out_features // BLOCK), 3, dtype=torch.int64)
    blocks = _padded(b.T).view(-1, BLOCK, rank)  # [O/16, 16, r]
    live = (blocks != 0).any(dim=1)  # [O/16, r]: rows of B' not zero over the block
    rows = torch.arange(rank, device=b.device)
    first = torch.where(live, rows, rank).amin(dim=1)
    count = (torch.where(live, rows + 1, 0).amax(dim=1) - first).clamp(min=0)
    first = torch.where(count > 0, first, 0)
    offset = torch.cumsum(count, 0) - count
    which = torch.repeat_interleave(torch.arange(len(blocks), device=b.device), count)
    row = torch.arange(len(which), device=b.device) - offset[which] + first[which]
    tiles = blocks[which, :, row].contiguous()  # [n, 16]
    return tiles.view(torch.int16), torch.stack([first, count, offset], dim=1).to(torch.int64).contiguous()


def woq_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, kind: str,
               out_features: int, group_size: int = DEFAULT_GROUP_SIZE,
               correction: tuple[torch.Tensor, torch.Tensor] | None = None, vectorised: bool = True,
               correction_tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
               activations: str = "int8", gate: tuple[int, int] | None = None) -> torch.Tensor:
    """`x [..., K]` (any float dtype) -> `[..., O]` in x's dtype by the kernel (`vectorised=False`: its scalar
    path), plus `correction` as in `reference_linear` (`gate` too), in one call; int8 / int4 quantise `x` per row
    and group, in one int8 pass or two (`activations`, module docstring); fp32 / bf16 do not round it.
    `correction_tiles`: B' as `tile_correction` lays it out for the kernel (made from `correction` when not given;
    a layer that keeps one makes it once)."""
    check_activations(activations)
    a = tiles = index = None
    if correction is not None:
        a = correction[0]
        tiles, index = correction_tiles if correction_tiles is not None else tile_correction(correction[1])
    period, start = gate or (1, 0)
    return extension().woq_linear(x, qweight, scale, zero, KINDS[kind], out_features, group_size, TILE_K, vectorised,
                                  a, tiles, index, ACTIVATIONS[activations], period, start)


def pack_experts(weights: torch.Tensor, kind: str, group_size: int = DEFAULT_GROUP_SIZE,
                 name: str = "experts") -> dict[str, torch.Tensor]:
    """Every expert's `W_e [O, K]` (`weights [E, O, K]`) packed as `pack` packs one, stacked along a first dimension
    of E (what `moe`'s kernel indexes by expert)."""
    packed = [pack(w, kind, group_size, f"{name}[{e}]") for e, w in enumerate(weights)]
    return {key: torch.stack([p[key] for p in packed]) for key in packed[0]}


def unpack_experts(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, kind: str, out_features: int,
                   in_features: int, group_size: int = DEFAULT_GROUP_SIZE) -> torch.Tensor:
    """`pack_experts`' tensors -> the dense fp32 `[E, O, K]` weights they stand for."""
    return torch.stack([unpack(qweight[e], scale[e], zero[e], kind, out_features, in_features, group_size)
                        for e in range(qweight.shape[0])])


def moe(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool, gate_up: tuple, down: tuple,
        shared: tuple[tuple, tuple, torch.Tensor] | None = None, activations: str = "int8",
        vectorised: bool = True) -> torch.Tensor:
    """A sparse MoE layer by the extension (csrc/moe.cpp), in one call: `x [T, H]` fp32, `router [E, H]` fp32; the
    softmax's top `top_k` experts per token (`normalize`: their weights renormalised to sum to 1), each chosen
    expert's rows through its SwiGLU, grouped by expert, the weighted sum; `shared`: `(gate_up, down, gate [H])`, a
    shared expert added with weight `sigmoid(gate . x)`. `gate_up` / `down`: `(qweight, scale, zero, kind code,
    out_features, group_size)` of `pack_experts`' tensors (`[E, 2I, H]`, gate rows then up; `[E, H, I]`); the shared
    expert's the same with E = 1. `moe_reference` is what it computes, but for int8 / int4's rounding of the
    activations (as `woq_linear`'s, `activations`)."""
    check_activations(activations)
    shared_gate_up = shared_down = gate = None
    if shared is not None:
        shared_gate_up, shared_down, gate = shared
    return extension().moe(x, router, top_k, normalize, gate_up, down, shared_gate_up, shared_down, gate,
                           ACTIVATIONS[activations], vectorised)


def moe_reference(x: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool, gate_up: torch.Tensor,
                  down: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                  ) -> torch.Tensor:
    """What `moe` computes, token by token in fp32 over dense weights (`gate_up [E, 2I, H]`, `down [E, H, I]`,
    `shared`: `(gate_up [2I', H], down [H, I'], gate [H])`): the tests' yardstick."""
    x = x.float()
    out = torch.zeros_like(x)
    for t, row in enumerate(x):
        probs = (router.float() @ row).softmax(dim=-1)
        weights, chosen = probs.topk(top_k)
        if normalize:
            weights = weights / weights.sum()
        for w, e in sorted(zip(weights.tolist(), chosen.tolist()), key=lambda pair: pair[1]):  # ascending expert
            gate, up = (gate_up[e].float() @ row).chunk(2)
            out[t] += (down[e].float() @ (F.silu(gate) * up)) * w
        if shared is not None:
            gate, up = (shared[0].float() @ row).chunk(2)
            out[t] += torch.sigmoid(shared[2].float() @ row) * (shared[1].float() @ (F.silu(gate) * up))
    return out


def has_avx2() -> bool:
    """Whether the kernel's AVX2+FMA path runs on this CPU (otherwise its portable scalar path does)."""
    return bool(extension().has_avx2())


def has_vnni() -> bool:
    """Whether int8 / int4 layers take AVX512-VNNI's dot product on this CPU (the same bits as AVX2's, faster from
    4 rows of codes; `$CLOVER_WOQ_VNNI=0` turns it off, read once per process)."""
    return bool(extension().has_vnni())
