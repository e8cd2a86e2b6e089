"""vLLM against `clover serve` on the default model, clover-smol: single requests and 16 concurrent streams.

    python benchmarks/bench_vllm.py [--streams 16] [--requests-per-stream 2] [--max-tokens 32] [--single 4]

Three servers, one after the other, each driven by benchmarks/bench_server.py's client code (`stream_chat`,
`load`: streaming chat, `ignore_eos`, temperature 0):

* `clover serve` as a user starts it (its default build: int4 on a CPU with AVX2, exact mode);
* `clover serve --engine vllm --dtype float32` (vLLM's CPU build on clover-smol's fp32 checkpoint, greedy);
* the same with vLLM's `ngram` speculation (prompt lookup, lossless: verified by the model), 4 tokens per draft.

Per server: `--single` requests one at a time (time to first token, tokens/s over the request), then `--streams`
concurrent clients of `--requests-per-stream` requests; tokens per forward from the server's metrics. Writes
benchmarks/results/bench_vllm.json. Needs the environment scripts/setup_vllm.sh makes. On a shared machine, other
load moves every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import ROOT, Server, cpu_name, healthy, load, percentiles, stream_chat  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
SERVERS = {
    "clover serve (default: int4, exact mode)": [],
    "vLLM fp32": ["--engine", "vllm", "--dtype", "float32"],
    "vLLM fp32 + ngram": ["--engine", "vllm", "--dtype", "float32", "--", "--speculative-config", json.dumps(NGRAM)],
}


async def single(url: str, count: int, max_tokens: int) -> dict:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) as client:
        rs = [await stream_chat(client, [{"role": "user", "content": f"Write a Python function that returns the "
                                          f"{k + 2}-th Fibonacci number, then explain it."}], max_tokens,
                                extra_body={"ignore_eos": True}) for k in range(count)]
    return {"ttft": percentiles([r["ttft"] for r in rs]),
            "tokens_per_s": sum(r["completion"] for r in rs) / sum(r["total"] for r in rs),
            "decode_tokens_per_s": sum(r["completion"] - 1 for r in rs) / sum(r["total"] - r["ttft"] for r in rs)}


def tokens_per_forward(url: str) -> float | None:
    """Generated tokens per model forward over the server's life, from its Prometheus counters: Clover's
    (`clover_generation_tokens` / `clover_request_forward_passes`) or vLLM's speculative ones (each draft is one
    verifying forward that yields its accepted tokens + 1); None: no such counters (vLLM without speculation: 1)."""
    import httpx

    totals: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{")[0].split(" ")[0], line.rsplit(" ", 1)[1]
            totals[name] = totals.get(name, 0.0) + float(value)
    if totals.get("clover_request_forward_passes_total"):
        return totals["clover_generation_tokens_total"] / totals["clover_request_forward_passes_total"]
    drafts = totals.get("vllm:spec_decode_num_drafts_total")
    return 1 + totals["vllm:spec_decode_num_accepted_tokens_total"] / drafts if drafts else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--single", type=int, default=4, help="requests one at a time")
    ap.add_argument("--single-max-tokens", type=int, default=64)
    ap.add_argument("--max-seconds", type=float, default=240)
    ap.add_argument("--start-timeout", type=float, default=900, help="seconds a server may take to start")
    ap.add_argument("--servers", nargs="+", choices=list(SERVERS), default=list(SERVERS))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_vllm.json")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    results = {"machine": f"{cpu_name()}, {os.cpu_count()} cores", "args": vars(args) | {"out": str(args.out)},
               "servers": {}}
    print(f"machine: {results['machine']} (shared: other load moves every figure)")
    print("| server | single: TTFT p50 (s) | single: tok/s | single: decode tok/s | "
          f"{args.streams} streams: tok/s | TTFT p50 / p95 (s) | latency p50 (s) | tokens / forward |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label in args.servers:
        start = time.perf_counter()
        server = Server(None, 1, "--max-num-seqs", str(args.streams), *SERVERS[label])
        if not healthy(server.url, server.proc, args.start_timeout):  # vLLM starts in minutes on a busy machine
            server.proc.terminate()
            raise SystemExit(f"{label}: not healthy after {args.start_timeout:g} s")
        with server:
            ready = time.perf_counter() - start
            asyncio.run(load(server.url, 1, 1, 4, 60))  # warm-up (first-call costs)
            one = asyncio.run(single(server.url, args.single, args.single_max_tokens))
            many = asyncio.run(load(server.url, args.streams, args.requests_per_stream, args.max_tokens,
                                    args.max_seconds))
            per_forward = tokens_per_forward(server.url)
        results["servers"][label] = {"start_s": ready, "single": one, "load": many,
                                     "tokens_per_forward": per_forward}
        print(f"| {label} | {one['ttft']['p50']:.2f} | {one['tokens_per_s']:.1f} | {one['decode_tokens_per_s']:.1f} "
              f"| {many['tokens_per_s']:.1f} | {many['ttft']['p50']:.2f} / {many['ttft']['p95']:.2f} "
              f"| {many['latency']['p50']:.2f} | {per_forward or 1:.2f} |", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
