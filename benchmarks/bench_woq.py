"""The packed-weight kernel alone (clover.ops.woq) per format, shape and row count.

    python benchmarks/bench_woq.py [--kinds fp32,bf16,int8,int4] [--shapes 3072x576,49152x576] [--rows 1,4,8,16]
        [--threads 1] [--repeats 20]

* Kernel: `woq_linear` of random weights `[O, K]` over R random rows (us, fastest of `--repeats`, after a warm-up),
  and the bytes it reads over that time (GB/s). 3072x576 is clover-smol's fused gate/up projection, 49152x576 its
  LM head. What a format does to clover-smol's next-token choices: benchmarks/bench_quant_agreement.py.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from clover.ops import woq


def kernel_us(shape: tuple[int, int], kind: str, rows: int, repeats: int) -> tuple[float, int]:
    out_features, in_features = shape
    packed = woq.pack(torch.randn(out_features, in_features), kind)
    x = torch.randn(rows, in_features)
    woq.woq_linear(x, **packed, kind=kind, out_features=out_features)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        woq.woq_linear(x, **packed, kind=kind, out_features=out_features)
        best = min(best, time.perf_counter() - start)
    return 1e6 * best, sum(t.numel() * t.element_size() for t in packed.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="fp32,bf16,int8,int4")
    parser.add_argument("--shapes", default="3072x576,49152x576")
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kinds = args.kinds.split(",")
    for kind in kinds:
        if kind not in woq.KINDS:
            parser.error(f"unknown kind {kind!r}: expected some of {list(woq.KINDS)}")
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}, "
          f"AVX2 path: {woq.has_avx2()}")
    for shape in [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]:
        for kind in kinds:
            cells = []
            for r in rows:
                us, nbytes = kernel_us(shape, kind, r, args.repeats)
                cells.append(f"R={r}: {us:7.0f} us ({nbytes / us / 1e3:4.1f} GB/s)")
            print(f"{shape[0]}x{shape[1]} {kind:5} " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
