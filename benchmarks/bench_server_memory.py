"""The server's resident memory under agent-like growing conversations, against what its prefix cache holds.

    python benchmarks/bench_server_memory.py [--model DIR] [--conversations 4] [--turns 6] [--max-tokens 64]
        [--allocators default mmap-64k arena-1] [--out benchmarks/results/bench_server_memory]

`--conversations` conversations grow turn by turn, as an agent's do: each turn appends a user message of about
250 tokens (slices of this repository's Python source, deterministic) and the server's greedy answer, and sends
the whole conversation again; the conversations take turns. After every request: the server process's resident
memory and its peak (`/proc`), and the prefix cache's bytes and entries (`/metrics`). Growth beyond the cache's
growth is memory that no cached prefix explains.

`--allocators` runs the same load once per C-heap setting, each in a fresh server: `default` (glibc's own, whose
mmap threshold rises to the size of each large block freed), `mmap-64k` (`MALLOC_MMAP_THRESHOLD_=65536`: blocks
of 64 KiB and more get their own mapping, returned to the system when freed) and `arena-1`
(`MALLOC_ARENA_MAX=1`: one heap for every thread). Wall time per run is
printed too; read it as a rough cost only (one run each, not taking turns). `--model` none: the default model
and build. Linux only (`/proc`). Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench_server import Server, cpu_name, write_results

ROOT = Path(__file__).resolve().parents[1]
ALLOCATORS = {"default": {}, "mmap-64k": {"MALLOC_MMAP_THRESHOLD_": "65536"}, "arena-1": {"MALLOC_ARENA_MAX": "1"}}


def source_slices(size: int = 900) -> list[str]:
    texts = [p.read_text() for p in sorted((ROOT / "clover").rglob("*.py"))]
    return [t[i: i + size] for t in texts for i in range(0, len(t), size)]


def cache_figures(url: str) -> tuple[float, float]:
    """(prefix cache MiB, entries) from the server's Prometheus metrics."""
    text = urllib.request.urlopen(f"{url}/metrics").read().decode()
    value = lambda name: float(re.search(rf"^{name} (\S+)", text, re.M).group(1))  # noqa: E731
    return value("clover_prefix_cache_bytes") / 2**20, value("clover_prefix_cache_entries")


def run(model: Path | None, allocator: str, args: argparse.Namespace) -> dict[str, Any]:
    from openai import OpenAI

    slices = source_slices()
    saved = {k: os.environ.get(k) for k in ALLOCATORS[allocator]}
    os.environ.update(ALLOCATORS[allocator])  # the server subprocess inherits it
    try:
        server = Server(model, None, "--log-level", "warning")
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    rows = []
    with server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)
        convs = [[{"role": "system", "content": "You are a coding agent. " + slices[7 * i]}]
                 for i in range(args.conversations)]
        nxt = 100
        start = time.perf_counter()
        for turn in range(args.turns):
            for c, messages in enumerate(convs):
                messages.append({"role": "user", "content": slices[nxt % len(slices)]})
                nxt += 1
                reply = client.chat.completions.create(model="bench", messages=messages,
                                                       max_tokens=args.max_tokens, temperature=0)
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
                rss, peak = server.memory_mib()
                cache_mib, entries = cache_figures(server.url)
                rows.append({"turn": turn, "conversation": c, "prompt_tokens": reply.usage.prompt_tokens,
                             "rss_mib": rss, "peak_mib": peak, "cache_mib": cache_mib, "cache_entries": entries})
            r = rows[-1]
            print(f"{allocator}: turn {turn}: prompt {r['prompt_tokens']} tokens, resident {r['rss_mib']:.0f} MiB "
                  f"(peak {r['peak_mib']:.0f}), prefix cache {r['cache_mib']:.0f} MiB", flush=True)
        wall = time.perf_counter() - start
    first, last = rows[0], rows[-1]
    return {"allocator": allocator, "env": ALLOCATORS[allocator], "rows": rows, "wall_s": wall,
            "rss_growth_mib": last["rss_mib"] - first["rss_mib"],
            "cache_growth_mib": last["cache_mib"] - first["cache_mib"], "peak_mib": last["peak_mib"]}


def report(results: dict[str, Any]) -> list[str]:
    lines = ["# The server's memory under growing conversations", "", f"`{results['command']}`", "",
             f"Machine: {results['machine']}. Model: {results['model']}. {results['conversations']} conversations "
             f"x {results['turns']} turns, {results['max_tokens']} answer tokens, greedy.", "",
             "| allocator | resident growth (MiB) | prefix cache growth (MiB) | unexplained (MiB) | peak (MiB) | "
             "wall (s) |", "|---|---:|---:|---:|---:|---:|"]
    for r in results["runs"]:
        lines.append(f"| {r['allocator']} | {r['rss_growth_mib']:.0f} | {r['cache_growth_mib']:.0f} | "
                     f"{r['rss_growth_mib'] - r['cache_growth_mib']:.0f} | {r['peak_mib']:.0f} | {r['wall_s']:.1f} |")
    return lines + ["", "Growth: from after the first request to after the last."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the default model)")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--allocators", nargs="+", choices=list(ALLOCATORS), default=list(ALLOCATORS))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/bench_server_memory")
    args = ap.parse_args()
    if not Path("/proc/self/status").exists():
        sys.exit("bench_server_memory reads /proc: Linux only")
    results: dict[str, Any] = {
        "command": "python benchmarks/bench_server_memory.py " + " ".join(sys.argv[1:]),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores",
        "model": str(args.model) if args.model else "clover-smol (default build)",
        "conversations": args.conversations, "turns": args.turns, "max_tokens": args.max_tokens,
        "runs": [run(args.model, a, args) for a in args.allocators]}
    lines = report(results)
    write_results(args.out, results, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
