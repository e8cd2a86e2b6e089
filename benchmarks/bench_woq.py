"""The packed-weight kernel alone (clover.ops.woq) per format, shape and row count, and what int8/int4 do to
clover-smol's next-token choices.

    python benchmarks/bench_woq.py [--kinds fp32,bf16,int8,int4] [--shapes 3072x576,49152x576] [--rows 1,4,8,16]
        [--threads 1] [--repeats 20] [--agreement 400] [--text docs/cpu.md]

* Kernel: `woq_linear` of random weights `[O, K]` over R random rows (us, fastest of `--repeats`, after a warm-up),
  and the bytes it reads over that time (GB/s). 3072x576 is clover-smol's fused gate/up projection, 49152x576 its
  LM head.
* `--agreement N`: the share of the first N next-token predictions (argmax of the logits over a text, one
  uncached forward) on which each quantised clover-smol agrees with the fp32 model (`--quant none`).
"""

from __future__ import annotations

import argparse
import copy
import platform
import time
from pathlib import Path

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


def agreement(tokens: int, text: Path, kinds: list[str]) -> dict[str, float]:
    from clover.model import CloverForBlockDiffusion, quantize
    from clover.smol import clover_smol_dir
    from clover.tokenizer import load_tokenizer

    path = clover_smol_dir()
    ids = torch.tensor([load_tokenizer(path).encode(text.read_text())[: tokens + 1]])
    if ids.shape[1] <= tokens:
        raise ValueError(f"{text} has only {ids.shape[1]} tokens, fewer than --agreement {tokens} + 1")
    with torch.inference_mode():
        model = CloverForBlockDiffusion.from_pretrained(path, dtype=torch.float32)
        want = model(ids[:, :-1]).logits.argmax(-1)
        return {kind: (quantize(copy.deepcopy(model), kind)(ids[:, :-1]).logits.argmax(-1) == want)
                .float().mean().item() for kind in kinds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="fp32,bf16,int8,int4")
    parser.add_argument("--shapes", default="3072x576,49152x576")
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--agreement", type=int, default=0, help="tokens of --text to compare (0: skip)")
    parser.add_argument("--text", default=str(Path(__file__).resolve().parents[1] / "docs" / "cpu.md"))
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
    if args.agreement:
        quantised = [k for k in kinds if k in ("int8", "int4")]
        for kind, share in agreement(args.agreement, Path(args.text), quantised).items():
            print(f"top-1 agreement with fp32 over {args.agreement} tokens of {Path(args.text).name}: "
                  f"{kind} {share:.3f}")


if __name__ == "__main__":
    main()
