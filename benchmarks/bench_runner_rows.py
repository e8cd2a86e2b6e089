"""The cost of verifying k rows on the llama.cpp runner as the context grows: what an agent's long prompts do to drafts.

    python benchmarks/bench_runner_rows.py [--quant q4_0] [--contexts 512,2048,4500] [--rows 1,2,4,8]
        [--kv f16,f32] [--threads 2] [--repeats 3] [--out F]

clover-smol's GGUF export (`clover.smol.clover_smol_gguf`), one row. For each KV type (`f16`: llama.cpp's flash
attention, the runner's default; `f32`: flash attention off) and context length: the context is prefilled in
256-token chunks of random token ids (attention's cost does not depend on them: `clover.engine.drafts.cost.extend`),
then forwards of `k` causal tokens (exact mode's verification shape: block size 1, logits at every row) are timed
and rewound as the cost table times them (`clover.engine.drafts.cost.time_forwards`): the counts taking turns, fresh
tokens each forward, two passes of `--repeats` rounds, each count the lower of its passes' medians, a count off
the curve's shape timed once more. (Before this script shared the cost table's timing, a figure was the median of
`--repeats` forwards of one count in a row, on the context's last tokens.) Prints ms per forward, its ratio to one
row and the ms each row beyond the first adds: where that increment nears a whole row's cost, verifying drafts
saves only the weights' reading, not attention's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import machine  # noqa: E402  (benchmarks/, next to this script)

from clover.engine.drafts.cost import CALIBRATION_REPEATS, extend, time_forwards  # noqa: E402
from clover.runners.llamacpp import LlamaCppRunner  # noqa: E402
from clover.smol import clover_smol_gguf  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def measure(path: Path, kv: str, contexts: list[int], rows: list[int], threads: int, repeats: int) -> list[dict]:
    runner = LlamaCppRunner(path, threads=threads, max_rows=1, kv_type=kv, flash_attn=kv == "f16")
    gen = torch.Generator().manual_seed(0)
    out = []
    try:
        for n in contexts:
            cache = runner.new_cache(1)
            start = time.perf_counter()
            extend(runner, cache, n, runner.config.vocab_size, gen)
            prefill = time.perf_counter() - start
            seconds = time_forwards(runner, cache, rows, repeats, vocab=runner.config.vocab_size, gen=gen)
            row = {"kv": kv, "context": n, "prefill_tok_s": round(n / prefill, 1),
                   "ms": {k: round(1000 * t, 2) for k, t in zip(rows, seconds)}}
            one = row["ms"][rows[0]]
            row["ratio"] = {k: round(ms / one, 2) for k, ms in row["ms"].items()}
            print(f"kv {kv:4} context {n:5}: prefill {row['prefill_tok_s']:7.1f} tok/s; "
                  + ", ".join(f"{k} rows {ms:6.1f} ms ({row['ratio'][k]:.2f}x)" for k, ms in row["ms"].items()),
                  flush=True)
            out.append(row)
            cache.release()
    finally:
        runner.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quant", choices=("q4_0", "q8_0"), default="q4_0")
    p.add_argument("--contexts", type=ints, default=[512, 2048, 4500])
    p.add_argument("--rows", type=ints, default=[1, 2, 4, 8])
    p.add_argument("--kv", default="f16,f32", help="comma-separated KV types: f16 (flash attention), f32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=CALIBRATION_REPEATS, help="rounds a pass (two passes)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args()
    path = clover_smol_gguf(args.quant)
    where = machine()
    print(f"# {path.name}, {args.threads} threads; {where}", flush=True)
    results = [r for kv in args.kv.split(",") for r in measure(path, kv, args.contexts, args.rows, args.threads,
                                                              args.repeats)]
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "machine": where, "gguf": path.name,
                                        "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
