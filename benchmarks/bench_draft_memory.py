"""The drafting memory's own cost: bytes per token kept, time to add an answer, time to look up a draft.

    python benchmarks/bench_draft_memory.py [--tokens 200000] [--answer 256] [--lookups 2000]
        [--out benchmarks/results/bench_draft_memory]

Answers are slices of `--answer` tokens of real text: this repository's Python source and docs, tokenized with
clover-smol's tokenizer (text that repeats itself as agents' answers do: names, signatures, phrasing). They are
added to a `DraftMemory` as large as the run, once under `tracemalloc` (the memory's bytes per token: its store,
chains and index) and once timed without it; then `--lookups` contexts (32 tokens ending at random places of the
same text) are looked up: the time per lookup and the share that found a draft. Written as JSON and Markdown.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_server import machine, write_results  # noqa: E402

from clover.engine.drafts.draft_memory import MAX_MATCH, DraftMemory  # noqa: E402
from clover.engine.loops.exact import COPIED_MOST  # noqa: E402
from clover.smol import clover_smol_dir  # noqa: E402
from clover.tokenizer import load_tokenizer  # noqa: E402


def corpus_ids(limit: int) -> list[int]:
    tokenizer = load_tokenizer(clover_smol_dir())
    files = sorted((ROOT / "clover").rglob("*.py")) + sorted((ROOT / "docs").glob("*.md"))
    ids: list[int] = []
    for path in files:
        ids += tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]
        if len(ids) >= limit:
            break
    return ids[:limit]


def fill(ids: list[int], answer: int) -> DraftMemory:
    memory = DraftMemory(capacity=len(ids))
    for start in range(0, len(ids), answer):
        memory.add(ids[start:start + answer])
    return memory


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=200_000)
    p.add_argument("--answer", type=int, default=256, help="tokens per answer added")
    p.add_argument("--lookups", type=int, default=2000)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_draft_memory")
    args = p.parse_args(argv)
    conditions = machine()
    ids = corpus_ids(args.tokens)
    tracemalloc.start()
    memory = fill(ids, args.answer)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del memory
    start = time.perf_counter()
    memory = fill(ids, args.answer)
    add_s = time.perf_counter() - start
    rng = random.Random(0)
    ends = [rng.randrange(64, len(ids)) for _ in range(args.lookups)]
    start, found = time.perf_counter(), 0
    for end in ends:
        found += memory.drafts(ids[end - MAX_MATCH:end], COPIED_MOST) is not None
    lookup_s = time.perf_counter() - start
    report = {"command": "python benchmarks/bench_draft_memory.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": conditions,
              "tokens": len(memory),
              "bytes_per_token": held / len(memory), "add_us_per_token": add_s / len(memory) * 1e6,
              "lookup_us": lookup_s / args.lookups * 1e6, "lookups_with_a_draft": found / args.lookups,
              **memory.stats()}
    lines = ["# bench_draft_memory", "", f"Command: `{report['command']}`  ", f"Machine: {report['machine']}", "",
             "| tokens kept | bytes / token | add (µs / token) | lookup (µs) | lookups with a draft |",
             "|---:|---:|---:|---:|---:|",
             f"| {report['tokens']} | {report['bytes_per_token']:.0f} | {report['add_us_per_token']:.1f} | "
             f"{report['lookup_us']:.0f} | {report['lookups_with_a_draft']:.2f} |"]
    write_results(args.out, report, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
