"""The cost of verifying k rows on the llama.cpp runner as the context grows: what an agent's long prompts do to drafts.

    python benchmarks/bench_runner_rows.py [--quant q4_0] [--contexts 512,2048,4500] [--rows 1,2,4,8]
        [--kv f16,f32] [--threads 2] [--repeats 8] [--out F]

clover-smol's GGUF export (`clover.smol.clover_smol_gguf`), one row. For each KV type (`f16`: llama.cpp's flash
attention, the runner's default; `f32`: flash attention off) and context length: the context is prefilled in
256-token chunks (random token ids: attention's cost does not depend on them), then a forward of `k` causal tokens
(exact mode's verification shape: block size 1, logits at every row) is timed and rewound, `--repeats` times, the
median kept. Prints ms per forward, its ratio to one row and the ms each row beyond the first adds: where that
increment nears a whole row's cost, verifying drafts saves only the weights' reading, not attention's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import machine  # noqa: E402  (benchmarks/, next to this script)

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
            ids = torch.randint(0, runner.config.vocab_size, (1, n), generator=gen)
            start = time.perf_counter()
            for s in range(0, n, 256):
                runner.forward(ids[:, s:s + 256], 1, cache=cache, logits_to_keep=0)
            prefill = time.perf_counter() - start
            row = {"kv": kv, "context": n, "prefill_tok_s": round(n / prefill, 1), "ms": {}}
            for k in rows:
                times = []
                for _ in range(repeats):
                    cache.mark()
                    start = time.perf_counter()
                    runner.forward(ids[:, -k:], 1, cache=cache, logits_at=torch.ones(1, k, dtype=torch.bool))
                    times.append(time.perf_counter() - start)
                    cache.rewind(torch.tensor([0]))
                row["ms"][k] = round(1000 * statistics.median(times), 2)
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
    p.add_argument("--repeats", type=int, default=8)
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
