"""The packed-weight kernel alone (clover.ops.woq) per format, shape and row count.

    python benchmarks/bench_woq.py [--kinds fp32,bf16,int8,int4] [--shapes 3072x576,49152x576] [--rows 1,4,8,16]
        [--activations int8,int8x2] [--threads 1] [--repeats 20] [--dense] [--out FILE.json]

* Kernel: `woq_linear` of random weights `[O, K]` over R random rows (us, fastest of `--repeats`, after a warm-up),
  and the bytes it reads over that time (GB/s). 3072x576 is clover-smol's fused gate/up projection, 49152x576 its
  LM head (960x576 its fused q/k/v, 576x1536 its down projection). int8 / int4 run once per `--activations`
  choice (one or two int8 passes over x), the choices taking turns in every repeat, so a burst of load from
  elsewhere hits them alike. What a format does to clover-smol's next-token choices:
  benchmarks/bench_quant_agreement.py.
* `--dense` (int8 / int4): the two ways a layer that rounds its input twice can read a prompt's rows
  (`clover.model.prompt_rows.prompt_matmul`): the kernel, and the weights decoded by `woq.dequantize` for torch's fp32
  matmul (ms, the two taking turns); and `woq.dequantize` alone in G weights/s, vectorised (AVX2) against its
  portable loop.

The machine line says whether the int8 / int4 tiles take AVX512-VNNI's dot product (`woq.has_vnni`;
`CLOVER_WOQ_VNNI=0` measures AVX2's on the same machine).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from clover.ops import woq


def kernel_us(shape: tuple[int, int], kind: str, rows: int, repeats: int,
              activations: list[str]) -> tuple[dict[str, float], int]:
    """us per call for each activation rounding (fastest of `repeats`, taking turns), and the packed bytes."""
    out_features, in_features = shape
    packed = woq.pack(torch.randn(out_features, in_features), kind)
    x = torch.randn(rows, in_features)
    best = dict.fromkeys(activations, float("inf"))
    for round_ in range(repeats + 1):  # the first round warms up
        for act in activations:
            start = time.perf_counter()
            woq.woq_linear(x, **packed, kind=kind, out_features=out_features, activations=act)
            if round_:
                best[act] = min(best[act], time.perf_counter() - start)
    return {act: 1e6 * t for act, t in best.items()}, sum(t.numel() * t.element_size() for t in packed.values())


def dense_ms(shape: tuple[int, int], kind: str, rows: int, repeats: int) -> dict[str, float]:
    """ms per call of the two-pass kernel and of dequantise + fp32 matmul as prompt rows run it
    (`PackedLinear.forward`; fastest of `repeats`, taking turns)."""
    out_features, in_features = shape
    packed = woq.pack(torch.randn(out_features, in_features), kind)
    x = torch.randn(rows, in_features)
    calls = {
        "kernel_int8x2": lambda: woq.woq_linear(x, **packed, kind=kind, out_features=out_features,
                                                activations="int8x2"),
        "dequantise_matmul": lambda: woq.reference_linear(
            x, **packed, kind=kind, out_features=out_features,
            weight=woq.dequantize(packed["qweight"], packed["scale"], packed["zero"], kind, out_features,
                                  in_features)),
    }
    return {name: 1e3 * t for name, t in _fastest(calls, repeats).items()}


def dequantise_rate(shape: tuple[int, int], kind: str, repeats: int) -> dict[str, float]:
    """G weights/s of `woq.dequantize`, vectorised and portable (fastest of `repeats`, taking turns)."""
    out_features, in_features = shape
    packed = woq.pack(torch.randn(out_features, in_features), kind)
    args = (packed["qweight"], packed["scale"], packed["zero"], kind, out_features, in_features)
    calls = {"vectorised": lambda: woq.dequantize(*args), "portable": lambda: woq.dequantize(*args, vectorised=False)}
    return {name: out_features * in_features / t / 1e9 for name, t in _fastest(calls, repeats).items()}


def _fastest(calls: dict, repeats: int) -> dict[str, float]:
    best = dict.fromkeys(calls, float("inf"))
    for round_ in range(repeats + 1):  # the first round warms up
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if round_:
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="fp32,bf16,int8,int4")
    parser.add_argument("--shapes", default="3072x576,49152x576")
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--activations", default="int8,int8x2", help="int8 / int4's activation roundings")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dense", action="store_true",
                        help="int8 / int4: the two-pass kernel against dequantise + fp32 matmul, and the dequantise "
                             "rate")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kinds = args.kinds.split(",")
    for kind in kinds:
        if kind not in woq.KINDS:
            parser.error(f"unknown kind {kind!r}: expected some of {list(woq.KINDS)}")
    activations = args.activations.split(",")
    for act in activations:
        if act not in woq.ACTIVATIONS:
            parser.error(f"unknown activation rounding {act!r}: expected some of {list(woq.ACTIVATIONS)}")
    rows = [int(r) for r in args.rows.split(",")]
    machine = (f"{platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}, "
               f"AVX2 path: {woq.has_avx2()}, AVX512-VNNI tiles: {woq.has_vnni()}")
    print(machine)
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    if args.dense:
        report: dict = {"machine": machine, "command": " ".join(sys.argv), "dense": []}
        for shape in shapes:
            for kind in (k for k in kinds if k in ("int8", "int4")):
                rate = dequantise_rate(shape, kind, args.repeats)
                print(f"{shape[0]}x{shape[1]} {kind} dequantise: {rate['vectorised']:.2f} G weights/s vectorised, "
                      f"{rate['portable']:.2f} portable", flush=True)
                cells = {r: dense_ms(shape, kind, r, args.repeats) for r in rows}
                print(f"{shape[0]}x{shape[1]} {kind} ms, kernel int8x2 / dequantise + matmul: " + "  ".join(
                    f"R={r}: {c['kernel_int8x2']:.2f} / {c['dequantise_matmul']:.2f}" for r, c in cells.items()),
                    flush=True)
                report["dense"].append({"shape": list(shape), "kind": kind, "dequantise_g_weights_per_s": rate,
                                        "ms_by_rows": cells})
        if args.out:
            args.out.write_text(json.dumps(report, indent=1) + "\n")
        return
    for shape in shapes:
        for kind in kinds:
            acts = activations if kind in ("int8", "int4") else activations[:1]  # fp32 / bf16 do not round x
            cells: dict[str, list[str]] = {act: [] for act in acts}
            for r in rows:
                times, nbytes = kernel_us(shape, kind, r, args.repeats, acts)
                for act, us in times.items():
                    cells[act].append(f"R={r}: {us:7.0f} us ({nbytes / us / 1e3:4.1f} GB/s)")
            for act, row in cells.items():
                label = f"{kind}/{act}" if kind in ("int8", "int4") else kind
                print(f"{shape[0]}x{shape[1]} {label:11} " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
