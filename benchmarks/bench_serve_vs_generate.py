"""`clover serve` against `clover generate` on the same prompts and build, in one run, taking turns.

    python benchmarks/bench_serve_vs_generate.py [--model DIR] [--rounds 3] [--max-tokens 128] [--threads N]
        [--sections single batch mixed] [--streams 16] [--out benchmarks/results/bench_serve_vs_generate]

Eight held-out coding prompts (none of them used to tune anything). Sections:

* **single**: one streamed request at a time. Per prompt and round, `clover generate --json` (a fresh process,
  as a user runs it) and one streamed chat request to a running `clover serve` take turns (the order flips every
  round, so neither always runs on a warmer machine). Decode rate after the first token, the same definition for
  both: `(tokens - 1) / (end - first token)`, generate's from its `--json` figures, the server's as its client sees
  it (first streamed delta to the last chunk). Both decode the same way (greedy; `generate` with the API's
  defaults `--dry-multiplier 0 --loop-guard 0`), and the run counts the requests whose texts agree. Verdict: the
  server's median over the generate median, >= 0.9.
* **batch**: the 16 prompts (the eight, twice) at once: the engine running them as one batch (`Engine.run`, in a
  fresh process loading the model as `clover generate` does) against 16 concurrent streams to the server.
  Aggregate tokens/s over the wall time, prefill included.
* **mixed**: 16 concurrent streams whose requests carry options of their own, in two comparisons taking turns,
  each with p95 time to first token, tok/s and errors: per-row options (thresholds 0.6-0.99, `ignore_eos`) under
  the threshold rule against one threshold (verdict: the ratio of p95 TTFT <= 1.5, 0 errors: per-row data must
  not split the batch or stall the event loop); and rules mixed too (`exact` and `threshold`: two batches, each
  stepped every iteration) against the default's one option set.

`--model` none: the default model and build, as `clover serve` / `clover generate` run it (clover-smol's int4
build on a CPU with AVX2). Writes `<out>.json` and `<out>.md`. On a shared machine absolute figures move with the
load: read the ratios, measured taking turns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_server import Server, cpu_name, percentiles, write_results

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = [  # held out: never used to tune drafting, the cost model or the server
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python class for a stack with push, pop and peek methods.",
    "Write a Python function that counts how often each word occurs in a text.",
    "Write a Python function that flattens a nested list of integers.",
    "Write a Python function that converts a Roman numeral to an integer.",
    "Write a Python function that removes duplicates from a list while keeping the order.",
    "Write a Python function that reads a CSV file and returns the sum of one column.",
]


def env(threads: int | None) -> dict[str, str]:
    out = {**os.environ, "PYTHONPATH": str(ROOT)}
    if threads:
        out["OMP_NUM_THREADS"] = str(threads)
    return out


def generate_once(model: Path | None, prompt: str, max_tokens: int, threads: int | None) -> dict[str, Any]:
    """`clover generate --json` on one prompt, in a fresh process: its decode rate after the first token. With the
    server's decoding (the CLI's DRY and loop guard off, as the API's defaults are), so both write the same text."""
    cmd = [sys.executable, "-m", "clover.cli.main", "generate", "--json", "--max-new-tokens", str(max_tokens),
           "--dry-multiplier", "0", "--loop-guard", "0",
           *(["--model", str(model)] if model else []), *(["--threads", str(threads)] if threads else []), prompt]
    out = json.loads(subprocess.run(cmd, env=env(threads), cwd=ROOT, check=True, capture_output=True,
                                    text=True).stdout)
    decode = out["wall_time_s"] - out["time_to_first_token_s"]
    return {"tokens": out["tokens"], "tps": (out["tokens"] - 1) / decode if decode > 0 else float("nan"),
            "ttft": out["time_to_first_token_s"], "tpf": out["tokens_per_forward"], "text": out["text"]}


async def serve_once(url: str, prompt: str, max_tokens: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chat request: the decode rate its client sees after the first token."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) as client:
        return await stream(client, prompt, max_tokens, extra)


async def stream(client: Any, prompt: str, max_tokens: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    start = time.perf_counter()
    first = usage = None
    text = []
    chunks = await client.chat.completions.create(
        model="bench", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, temperature=0.0, extra_body=extra)
    async for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text.append(c.delta.content or "")
            if first is None and (c.delta.content or getattr(c.delta, "reasoning_content", None)):
                first = time.perf_counter()
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage else 0
    first = first or end
    return {"tokens": tokens, "tps": (tokens - 1) / (end - first) if end > first else float("nan"),
            "ttft": first - start, "total": end - start, "text": "".join(text)}


def run_single(server: Server, model: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for rnd in range(args.rounds):
        for i, prompt in enumerate(PROMPTS):
            order = ("generate", "serve") if (rnd + i) % 2 == 0 else ("serve", "generate")
            got = {}
            for side in order:
                got[side] = (generate_once(model, prompt, args.max_tokens, args.threads) if side == "generate"
                             else asyncio.run(serve_once(server.url, prompt, args.max_tokens)))
            # the server's chat output starts at the answer's first non-blank character; generate prints all
            same = got["generate"].pop("text").strip() == got["serve"].pop("text").strip()
            rows.append({"round": rnd, "prompt": i, "same_text": same,
                         **{f"{s}_{k}": v for s in got for k, v in got[s].items()}})
            print(f"round {rnd} prompt {i}: generate {got['generate']['tps']:6.1f} tok/s "
                  f"({got['generate']['tokens']} tokens, TPF {got['generate']['tpf']:.2f}) | serve "
                  f"{got['serve']['tps']:6.1f} tok/s ({got['serve']['tokens']} tokens) | "
                  f"{'same text' if same else 'TEXT DIFFERS'}", flush=True)
    gen = statistics.median(r["generate_tps"] for r in rows)
    srv = statistics.median(r["serve_tps"] for r in rows)
    pair = statistics.median(r["serve_tps"] / r["generate_tps"] for r in rows)
    return {"rows": rows, "generate_tps_median": gen, "serve_tps_median": srv, "ratio_of_medians": srv / gen,
            "median_paired_ratio": pair, "same_text": sum(r["same_text"] for r in rows)}


ENGINE_CHILD = """
import json, sys, time
import torch
from clover.cli.loading import load_model
from clover.cli.main import build_parser
from clover.chat_template import render_chat
from clover.engine import Engine, SamplingParams
from clover.tokenizer import eos_token_ids
args = build_parser().parse_args(["generate", *sys.argv[3:], "x"])
if args.threads:
    torch.set_num_threads(args.threads)
runner, tok, _ = load_model(args)
prompts = json.loads(sys.argv[1])
ids = [tok(render_chat(tok, [{"role": "user", "content": p}], add_generation_prompt=True, enable_thinking=False),
           add_special_tokens=False)["input_ids"] for p in prompts]
engine = Engine(runner, detokenize=lambda t: tok.decode(t, skip_special_tokens=True), vocab_limit=len(tok),
                eos_token_ids=eos_token_ids(runner.config, tok))
for rep in range(2):  # the first run warms up (first-call costs), the second is timed
    start = time.perf_counter()
    tokens = sum(len(e.token_ids) for e in engine.run(ids, int(sys.argv[2]), SamplingParams()))
    wall = time.perf_counter() - start
print(json.dumps({"tokens": tokens, "wall_s": wall, "tps": tokens / wall}))
"""


def engine_batch(model: Path | None, prompts: list[str], max_tokens: int, threads: int | None) -> dict[str, Any]:
    flags = [*(["--model", str(model)] if model else []), *(["--threads", str(threads)] if threads else [])]
    out = subprocess.run([sys.executable, "-c", ENGINE_CHILD, json.dumps(prompts), str(max_tokens), *flags],
                         env=env(threads), cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


async def concurrent(url: str, prompts: list[str], max_tokens: int,
                     extras: list[dict[str, Any] | None]) -> dict[str, Any]:
    """All `prompts` at once, one stream each (`extras[i]`: request i's extra body); aggregate figures."""
    from openai import APIError, AsyncOpenAI

    errors = 0

    async def one(client: Any, prompt: str, extra: dict[str, Any] | None) -> dict[str, Any] | None:
        nonlocal errors
        try:
            return await stream(client, prompt, max_tokens, extra)
        except APIError:
            errors += 1
            return None

    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600) as client:
        start = time.perf_counter()
        results = [r for r in await asyncio.gather(*(one(client, p, e) for p, e in zip(prompts, extras))) if r]
        wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    return {"tokens": tokens, "wall_s": wall, "tps": tokens / wall, "errors": errors,
            "ttft": percentiles([r["ttft"] for r in results])}


def run_batch(server: Server, model: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    prompts = (PROMPTS * 2)[: args.streams]
    rows = []
    for rnd in range(args.rounds):
        got = {}
        for side in (("engine", "serve") if rnd % 2 == 0 else ("serve", "engine")):
            got[side] = (engine_batch(model, prompts, args.max_tokens, args.threads) if side == "engine" else
                         asyncio.run(concurrent(server.url, prompts, args.max_tokens, [None] * len(prompts))))
        rows.append({"round": rnd, "engine_tps": got["engine"]["tps"], "serve_tps": got["serve"]["tps"],
                     "serve_errors": got["serve"]["errors"]})
        print(f"round {rnd}: {len(prompts)} prompts: engine batch {got['engine']['tps']:6.1f} tok/s | "
              f"{len(prompts)} server streams {got['serve']['tps']:6.1f} tok/s", flush=True)
    eng = statistics.median(r["engine_tps"] for r in rows)
    srv = statistics.median(r["serve_tps"] for r in rows)
    paired = [r["serve_tps"] / r["engine_tps"] for r in rows]
    return {"rows": rows, "engine_tps_median": eng, "serve_tps_median": srv, "ratio": srv / eng,
            "median_paired_ratio": statistics.median(paired), "paired_min": min(paired), "paired_max": max(paired)}


MIXED = [{"rule": "exact"}, {"rule": "threshold", "threshold": 0.9}, {"rule": "threshold", "threshold": 0.7},
         {"rule": "exact", "ignore_eos": True}, {"rule": "threshold", "threshold": 0.95, "ignore_eos": True},
         {"rule": "threshold", "threshold": 0.8}, {"rule": "threshold", "threshold": 0.85}, {"rule": "exact"}]
# per-row options within one rule: one batch, whatever the thresholds
PER_ROW = [{"rule": "threshold", "threshold": t, "ignore_eos": i % 3 == 0}
           for i, t in enumerate([0.9, 0.7, 0.95, 0.8, 0.85, 0.75, 0.99, 0.6])]
ONE_THRESHOLD = {"rule": "threshold", "threshold": 0.9}


def compare(url: str, n: int, rounds: int, max_tokens: int, a: tuple[str, list],
            b: tuple[str, list]) -> dict[str, Any]:
    """Loads `a` and `b` (name, extra bodies cycled over the prompts) taking turns: p95 TTFT, tok/s, errors."""
    prompts = (PROMPTS * 2)[:n]
    rows = []
    for rnd in range(rounds):
        got = {}
        for name, extras in ((a, b) if rnd % 2 == 0 else (b, a)):
            got[name] = asyncio.run(concurrent(url, prompts, max_tokens, [extras[i % len(extras)] for i in range(n)]))
        rows.append({"round": rnd, **{f"{s}_{k}": v for s in got for k, v in got[s].items()}})
        print(f"round {rnd}: " + " | ".join(f"{s}: p95 TTFT {got[s]['ttft']['p95']:.2f} s, {got[s]['tps']:.1f} "
                                           f"tok/s, {got[s]['errors']} errors" for s in got), flush=True)
    out: dict[str, Any] = {"rows": rows, "errors": sum(r[f"{s}_errors"] for r in rows for s in (a[0], b[0]))}
    for s in (a[0], b[0]):
        out[f"{s}_ttft_p95"] = statistics.median(r[f"{s}_ttft"]["p95"] for r in rows)
        out[f"{s}_tps"] = statistics.median(r[f"{s}_tps"] for r in rows)
    out["ttft_p95_ratio"] = out[f"{b[0]}_ttft_p95"] / out[f"{a[0]}_ttft_p95"]
    return out


def run_mixed(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    """Per-row options in one rule against one option set of that rule (the verdict: per-row data must not
    split the batch or stall the loop), then rules and options mixed against the default's one set (two rules
    are two batches, each stepped every iteration, and the threshold rule decodes slower here on its own)."""
    load = (server.url, args.streams, args.rounds, args.max_tokens)
    return {"per_row": compare(*load, ("one", [ONE_THRESHOLD]), ("mixed", PER_ROW)),
            "rules": compare(*load, ("one", [None]), ("mixed", MIXED))}


def report(results: dict[str, Any]) -> list[str]:
    lines = [f"# `clover serve` against `clover generate`", "",
             f"`{results['command']}`", "",
             f"Machine: {results['machine']}; load average {results['load_before']:.1f} before, "
             f"{results['load_after']:.1f} after. Model: {results['model']}. {results['max_tokens']} new tokens, "
             f"{results['rounds']} rounds taking turns.", ""]
    verdicts = []
    if "single" in results:
        s = results["single"]
        ok = s["ratio_of_medians"] >= 0.9
        verdicts.append(f"single stream: serve / generate = {s['ratio_of_medians']:.2f} "
                        f"({'PASS' if ok else 'FAIL'}: >= 0.90)")
        lines += ["## One stream (decode tok/s after the first token)", "",
                  "| | generate | serve | serve / generate |", "|---|---:|---:|---:|",
                  f"| median | {s['generate_tps_median']:.1f} | {s['serve_tps_median']:.1f} | "
                  f"{s['ratio_of_medians']:.2f} |",
                  f"| median of paired ratios | | | {s['median_paired_ratio']:.2f} |", "",
                  f"Same text from both: {s['same_text']} of {len(s['rows'])} requests (greedy, the API's decoding: "
                  "DRY and the loop guard off).", ""]
    if "batch" in results:
        b = results["batch"]
        verdicts.append(f"{results['streams']} streams: serve / engine batch = {b['ratio']:.2f}")
        lines += [f"## {results['streams']} at once (aggregate tok/s, prefill included)", "",
                  "| engine, one batch | server, concurrent streams | ratio of medians | paired ratios: median "
                  "(min-max) |", "|---:|---:|---:|---:|",
                  f"| {b['engine_tps_median']:.1f} | {b['serve_tps_median']:.1f} | {b['ratio']:.2f} | "
                  f"{b['median_paired_ratio']:.2f} ({b['paired_min']:.2f}-{b['paired_max']:.2f}) |", ""]
    if "mixed" in results:
        m, r = results["mixed"]["per_row"], results["mixed"]["rules"]
        ok = m["ttft_p95_ratio"] <= 1.5 and m["errors"] == 0 and r["errors"] == 0
        verdicts.append(f"per-row options: p95 TTFT ratio {m['ttft_p95_ratio']:.2f}, {m['errors'] + r['errors']} "
                        f"errors ({'PASS' if ok else 'FAIL'}: <= 1.5, 0 errors); rules mixed: p95 TTFT ratio "
                        f"{r['ttft_p95_ratio']:.2f}")
        lines += [f"## {results['streams']} streams with options of their own", "",
                  "| load | p95 TTFT (s) | tok/s |", "|---|---:|---:|",
                  f"| threshold rule, one threshold (0.9) | {m['one_ttft_p95']:.2f} | {m['one_tps']:.1f} |",
                  f"| threshold rule, thresholds 0.6-0.99 and ignore_eos per request | {m['mixed_ttft_p95']:.2f} | "
                  f"{m['mixed_tps']:.1f} |",
                  f"| ratio | {m['ttft_p95_ratio']:.2f} | {m['mixed_tps'] / m['one_tps']:.2f} |",
                  f"| default (exact), one option set | {r['one_ttft_p95']:.2f} | {r['one_tps']:.1f} |",
                  f"| rules exact and threshold, thresholds, ignore_eos mixed | {r['mixed_ttft_p95']:.2f} | "
                  f"{r['mixed_tps']:.1f} |",
                  f"| ratio | {r['ttft_p95_ratio']:.2f} | {r['mixed_tps'] / r['one_tps']:.2f} |", "",
                  f"Errors: {m['errors'] + r['errors']}.", ""]
    return lines + ["## Verdict", "", *[f"- {v}" for v in verdicts], ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the default model)")
    ap.add_argument("--sections", nargs="+", choices=["single", "batch", "mixed"],
                    default=["single", "batch", "mixed"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads of both (default: torch's)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/bench_serve_vs_generate")
    args = ap.parse_args()
    results: dict[str, Any] = {
        "command": "python benchmarks/bench_serve_vs_generate.py " + " ".join(sys.argv[1:]),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores", "load_before": os.getloadavg()[0],
        "model": str(args.model) if args.model else "clover-smol (default build)", "max_tokens": args.max_tokens,
        "rounds": args.rounds, "streams": args.streams, "prompts": PROMPTS}
    print(f"machine: {results['machine']}, load average {results['load_before']:.1f}")
    flags = ["--max-num-seqs", str(max(args.streams, 32))]
    with Server(args.model, args.threads, *flags) as server:
        asyncio.run(serve_once(server.url, "Say hello.", 8))  # warm-up (first-call costs)
        if "single" in args.sections:
            results["single"] = run_single(server, args.model, args)
        if "batch" in args.sections:
            results["batch"] = run_batch(server, args.model, args)
        if "mixed" in args.sections:
            results["mixed"] = run_mixed(server, args)
    results["load_after"] = os.getloadavg()[0]
    lines = report(results)
    write_results(args.out, results, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
