"""The C++ kernels of this tree against those of a git revision: forwards of clover-smol's int4 build (or another
packed checkpoint, `--model`), same process.

    python benchmarks/bench_kernel_ab.py --baseline REV [--contexts 32,300,1500,4600] [--rows 1,2,4,8]
        [--repeats 15] [--threads 2] [--model DIR] [--out F]

`clover/ops/csrc` at `REV` is compiled beside this tree's (`$CLOVER_CACHE/extensions/`), and the two take turns
forward by forward on the same model and cache, so a slow moment of a shared machine hits both alike. Per context
length (tokens already cached) and row count (causal tokens fed, logits at each, as exact mode's verification
asks): the median milliseconds of each and their ratio; and whether the two computed the same logits bit for bit
(a kernel change that only reorders memory traffic should). `--out`: the same as JSON, with the machine and command.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from clover.model import CloverForBlockDiffusion
from clover.ops import woq
from clover.engine.runner import as_runner
from clover.smol import clover_smol_dir

ROOT = Path(__file__).resolve().parents[1]


def baseline_extension(rev: str) -> tuple[Any, str]:
    """The extension built from `clover/ops/csrc` as it was at `rev`, and the commit `rev` names."""
    git = ["git", "-C", str(ROOT)]
    found = subprocess.run(git + ["rev-parse", "--short=12", "--verify", "--quiet", f"{rev}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode:
        raise SystemExit(f"--baseline {rev!r} is not a commit of this repository ({ROOT})")
    commit = found.stdout.strip()
    src = Path(tempfile.mkdtemp(prefix=f"clover-csrc-{commit}-"))
    for path in woq.SOURCES + woq.HEADERS:
        shown = subprocess.run(git + ["show", f"{commit}:clover/ops/csrc/{path.name}"], capture_output=True, text=True)
        if shown.returncode:
            raise SystemExit(f"--baseline {commit} has no clover/ops/csrc/{path.name}: its kernels predate this "
                             "layout")
        (src / path.name).write_text(shown.stdout)
    extension = woq.compile_kernels(tuple(src / path.name for path in woq.SOURCES), f"baseline_{commit}")
    if not hasattr(extension, "decoder_layers"):
        raise SystemExit(f"--baseline {commit}'s kernels predate the layers' one-call stack (`decoder_layers`, "
                         "7779ddf) that this tree's model calls: compare against that commit or a later one")
    return extension, commit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="a git revision whose kernels to compare against")
    parser.add_argument("--contexts", default="32,300,1500,4600")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", type=Path, default=None,
                        help="a quantised checkpoint to run instead of clover-smol's int4 build (e.g. the hybrid twin "
                             "bench_hybrid.py packs: WORK/twin-int4)")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model or clover_smol_dir("int4")
    runner = as_runner(CloverForBlockDiffusion.from_pretrained(model))
    baseline, commit = baseline_extension(args.baseline)
    kernels = {"baseline": baseline, "this tree": woq.extension()}
    machine = (f"{platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}, "
               f"AVX512-VNNI tiles: {woq.has_vnni()}")
    print(f"machine: {machine}; {args.model or 'clover-smol int4'}, baseline {args.baseline} ({commit})")
    rows_out = []
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for context in (int(c) for c in args.contexts.split(",")):
            cache = runner.new_cache(1)
            for start in range(0, context, 512):  # the prefill, in chunks as the engine reads a prompt
                n = min(512, context - start)
                runner.forward(torch.randint(0, 1000, (1, n), generator=gen), 1, cache=cache, prefix_len=n,
                               logits_to_keep=0)
            for rows in (int(r) for r in args.rows.split(",")):
                ids = torch.randint(0, 1000, (1, rows), generator=gen)
                at = torch.ones(1, rows, dtype=torch.bool)
                times: dict[str, list[float]] = {name: [] for name in kernels}
                logits: dict[str, torch.Tensor] = {}
                for _ in range(args.repeats + 1):  # the first round warms caches up: not counted
                    for name, extension in kernels.items():
                        woq._extension = extension
                        cache.mark()
                        start = time.perf_counter()
                        logits[name] = runner.forward(ids, 1, cache=cache, prefix_len=rows, logits_at=at)
                        times[name].append(time.perf_counter() - start)
                        cache.rewind(torch.zeros(1, dtype=torch.long))
                base, new = (statistics.median(times[name][1:]) * 1e3 for name in kernels)
                same = torch.equal(logits["baseline"], logits["this tree"])
                print(f"context {context:5}  rows {rows:3}  baseline {base:7.2f} ms  this tree {new:7.2f} ms  "
                      f"x{new / base:.3f}  {'same logits' if same else 'logits differ'}", flush=True)
                rows_out.append({"context": context, "rows": rows, "baseline_ms": base, "this_tree_ms": new,
                                 "same_logits": same})
    woq._extension = kernels["this tree"]
    if args.out:
        args.out.write_text(json.dumps({"machine": machine, "command": " ".join(["benchmarks/bench_kernel_ab.py",
                                        *sys.argv[1:]]), "model": str(model), "baseline": commit,
                                        "forwards": rows_out}, indent=1))


if __name__ == "__main__":
    main()
