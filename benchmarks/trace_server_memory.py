"""Where the server's resident memory goes while one long prompt is prefilled, stored and resumed.

    python benchmarks/trace_server_memory.py [--tokens 7900] [--extend 150] [--budget-mb 512] [--threads 2]
        [--out benchmarks/results/trace_server_memory.json]

Runs, on one thread, what `clover serve` (its default model, build and options) runs for a request: a prompt of
`--tokens` token ids (deterministic, random: memory does not depend on which) prefilled chunk by chunk from cold
and stored in a prefix cache of `--budget-mb`, then the same prompt plus `--extend` tokens (an agent's next turn)
resumed from the store. After start-up and after every step: the process's resident memory (VmRSS), the C heap's
bytes in use and free (glibc `mallinfo2`), the request's KV buffers (their capacity) and the store's bytes;
`malloc_trim` runs where the server runs it (after start-up, between requests). Prints the table; writes `--out`.
Linux with glibc only.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path
from typing import Any

import torch

MIB = 2**20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def resident_mib() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process, MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def heap_mib() -> tuple[float, float]:
    """(bytes in use, free bytes kept) of glibc's heap, MiB."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / MIB, info.fordblks / MIB


def kv_capacity_mib(cache: Any) -> float:
    """Bytes of the attention KV buffers `cache` holds (their whole capacity), MiB."""
    return sum(t.untyped_storage().nbytes() for layer in cache.layers for t in (getattr(layer, "k", None),
                                                                                 getattr(layer, "v", None))
               if t is not None) / MIB


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=7900, help="the first prompt's length")
    p.add_argument("--extend", type=int, default=150, help="tokens the second prompt adds")
    p.add_argument("--budget-mb", type=float, default=512.0, help="the prefix cache's budget (the server's default)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from clover.cli.loading import load_model
    from clover.cli.main import build_parser
    from clover.cli.threads import set_threads
    from clover.engine import Engine, SamplingParams
    from clover.serving.scheduling.heap import release_free_heap
    from clover.serving.scheduling.prefix_cache import PrefixCache
    from clover.serving.served_model import ServerOptions

    serve = build_parser().parse_args(["serve", "--threads", str(args.threads)])
    set_threads(serve.threads)
    runner, _, _ = load_model(serve, device="cpu", max_rows=None)
    chunk = ServerOptions().prefill_chunk
    engine = Engine(runner, prefill_chunk=chunk)
    store = PrefixCache(chunk, int(args.budget_mb * MIB), recurrent=runner.config.has_linear_attention)
    rows: list[dict[str, Any]] = []

    def note(step: str, done: int = 0, cache: Any = None) -> None:
        rss, peak = resident_mib()
        used, free = heap_mib()
        rows.append({"step": step, "prompt_done": done, "rss_mib": rss, "peak_mib": peak, "heap_used_mib": used,
                     "heap_free_mib": free, "request_kv_mib": kv_capacity_mib(cache) if cache is not None else 0.0,
                     "store_mib": store.memory_bytes / MIB})

    release_free_heap()
    note("started")
    vocab = min(runner.config.vocab_size, 32000)
    first = torch.randint(100, vocab, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    second = first + torch.randint(100, vocab, (args.extend,), generator=torch.Generator().manual_seed(1)).tolist()
    for name, prompt in (("cold", first), ("resumed", second)):
        seq = engine.make_sequences([prompt], 32, SamplingParams())[0]
        with torch.inference_mode():
            reuse = store.find(prompt)
            note(f"{name}: looked up ({reuse.length if reuse else 0} reused)", 0, reuse.cache if reuse else None)
            prefill = engine.begin_prefill(seq, reuse.cache if reuse else None)
            del reuse
            batch = None
            while batch is None:
                batch = engine.prefill_step(prefill)
                note(f"{name}: prefill", prefill.done, prefill.cache)
            store.insert(prompt, prefill.cache, {})
            note(f"{name}: stored", prefill.done, prefill.cache)
            while batch is not None:
                _, batch = engine.step(batch)
            note(f"{name}: answered", prefill.done, prefill.cache)
        del prefill
        release_free_heap()
        note(f"{name}: idle (heap trimmed)")

    print("| step | prompt tokens | RSS (MiB) | peak (MiB) | heap used / free (MiB) | request KV (MiB) | store (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['step']} | {r['prompt_done']} | {r['rss_mib']:.0f} | {r['peak_mib']:.0f} | "
              f"{r['heap_used_mib']:.0f} / {r['heap_free_mib']:.0f} | {r['request_kv_mib']:.0f} | {r['store_mib']:.0f} |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
