"""A seed repeats through `clover serve`: the same seeded request alone and among 8 concurrent streams.

    python benchmarks/bench_seeds.py [--model DIR] [--threads N] [--max-tokens 64] [--rounds 3]
        [--temperature 0.7] [--out benchmarks/results/bench_seeds]

Eight held-out coding prompts (`bench_serve_vs_generate.py`'s), prompt `i` with seed `1000 + i`, at `--temperature`,
against one running `clover serve` (the default model and build unless `--model`, with its default rule: exact
mode on clover-smol):

* **alone**: each request whole (not streamed), then streamed, one request at a time;
* **block size 1**: each request with `block_size: 1, rule: threshold`, one at a time (exact mode's text with a seed
  is block size 1's);
* **8 streams**, `--rounds` times: the eight requests as 8 concurrent streams started 0.1 s apart (each joins a
  running batch at a different moment), in another order each round.

Per prompt: whether every one of its texts equals its alone-whole text. Per section: the server's generated tokens
per forward pass (its `/metrics` counters), which shows that drafting differed between the sections while the texts
did not.

Section **noise** (in this process, before the server starts): what a sampled token's position-keyed draw costs
at the default model's vocabulary (49152), `clover.engine.noise.race` on one distribution, against what the
sampler did before (a seeded `torch.Generator`'s `exponential_` over the vocabulary, then the same argmax), taking
turns, median of `--noise-trials` each. Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench_serve_vs_generate import PROMPTS
from bench_server import Server, cpu_name, write_results

ROOT = Path(__file__).resolve().parents[1]
STREAMS = 8
BLOCK1 = {"block_size": 1, "rule": "threshold"}


def counters(url: str) -> dict[str, float]:
    """The server's generated tokens and request forward passes so far (Prometheus counters)."""
    names = {"clover_generation_tokens_total": "tokens", "clover_request_forward_passes_total": "forwards"}
    out = {"tokens": 0.0, "forwards": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            out[names[name]] = float(value)
    return out


async def ask(client: Any, i: int, args: argparse.Namespace, stream: bool, extra: dict | None = None,
              delay: float = 0.0) -> str:
    """Prompt `i` with its seed; the answer's text."""
    await asyncio.sleep(delay)
    kwargs = dict(model="bench", messages=[{"role": "user", "content": PROMPTS[i]}], max_tokens=args.max_tokens,
                  temperature=args.temperature, seed=1000 + i, extra_body=extra)
    if not stream:
        return (await client.chat.completions.create(**kwargs)).choices[0].message.content or ""
    chunks = await client.chat.completions.create(**kwargs, stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])


async def section(url: str, name: str, run) -> dict[str, Any]:
    """Run `run(client)` (a coroutine returning {(prompt, label): text}), timed, with the server's tokens per
    forward over it."""
    from openai import AsyncOpenAI

    before = counters(url)
    start = time.perf_counter()
    async with AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=900) as client:
        texts = await run(client)
    after = counters(url)
    tokens, forwards = after["tokens"] - before["tokens"], after["forwards"] - before["forwards"]
    print(f"{name}: {len(texts)} answers in {time.perf_counter() - start:.1f} s, "
          f"{tokens / forwards if forwards else float('nan'):.3f} tokens per forward", flush=True)
    return {"texts": texts, "seconds": time.perf_counter() - start, "tokens": tokens, "forwards": forwards,
            "tokens_per_forward": tokens / forwards if forwards else None}


def run_all(url: str, args: argparse.Namespace) -> dict[str, Any]:
    n = len(PROMPTS)

    async def alone(client):
        out = {}
        for i in range(n):
            out[(i, "whole")] = await ask(client, i, args, stream=False)
            out[(i, "streamed")] = await ask(client, i, args, stream=True)
        return out

    async def block1(client):
        return {(i, "block size 1"): await ask(client, i, args, stream=False, extra=BLOCK1) for i in range(n)}

    def loaded(rnd: int):
        async def run(client):
            order = [(rnd * 3 + j) % n for j in range(n)]  # another order (and join moment) each round
            texts = await asyncio.gather(*(ask(client, i, args, stream=True, delay=0.1 * j)
                                           for j, i in enumerate(order)))
            return {(i, f"8 streams, round {rnd + 1}"): t for i, t in zip(order, texts)}
        return run

    sections = {"alone": asyncio.run(section(url, "alone", alone)),
                "block size 1": asyncio.run(section(url, "block size 1", block1))}
    for rnd in range(args.rounds):
        sections[f"8 streams, round {rnd + 1}"] = asyncio.run(section(url, f"8 streams, round {rnd + 1}", loaded(rnd)))
    per_prompt = []
    for i in range(n):
        texts = {label: t for s in sections.values() for (j, label), t in s["texts"].items() if j == i}
        ref = texts["whole"]
        per_prompt.append({"prompt": PROMPTS[i], "seed": 1000 + i, "answers": len(texts),
                           "differing": sorted(label for label, t in texts.items() if t != ref),
                           "text": ref})
    for s in sections.values():
        s["texts"] = {f"{i}: {label}": t for (i, label), t in s["texts"].items()}
    return {"sections": sections, "per_prompt": per_prompt}


def noise_cost(vocab: int, trials: int) -> dict[str, float]:
    """Median microseconds per sampled token: the keyed race against a seeded generator's race, taking turns."""
    import statistics

    import torch

    from clover.engine.noise import noise_key, race

    probs = torch.softmax(torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)), dim=-1)
    gen = torch.Generator().manual_seed(7)
    keyed, stream = [], []
    for t in range(trials):
        start = time.perf_counter()
        race(probs, [noise_key(7, t)])
        keyed.append(time.perf_counter() - start)
        start = time.perf_counter()
        (probs / torch.empty_like(probs).exponential_(generator=gen)).argmax(dim=-1)
        stream.append(time.perf_counter() - start)
    return {"vocab": vocab, "trials": trials, "threads": torch.get_num_threads(),
            "keyed_us": statistics.median(keyed) * 1e6, "generator_us": statistics.median(stream) * 1e6}


def report(results: dict[str, Any]) -> list[str]:
    lines = ["# A seed repeats through `clover serve`", "",
             f"Command: `{results['command']}`. Machine: {results['machine']}; load average {results['load_before']:.1f}"
             f" before, {results['load_after']:.1f} after.", ""]
    if "noise" in results:
        n = results["noise"]
        lines += ["## What a keyed draw costs", "",
                  f"One sampled token's draw over a vocabulary of {n['vocab']} ({n['threads']} torch threads, median of "
                  f"{n['trials']}, taking turns): position-keyed noise (`clover.engine.noise.race`) "
                  f"**{n['keyed_us']:.0f} us**, a seeded `torch.Generator`'s `exponential_` and the same argmax "
                  f"(the sampler before) {n['generator_us']:.0f} us.", ""]
    if "run" in results:
        lines += serve_report(results)
    return lines


def serve_report(results: dict[str, Any]) -> list[str]:
    r = results["run"]
    same = sum(not p["differing"] for p in r["per_prompt"])
    lines = ["## The same seeded request alone and among 8 streams", "",
             f"Model: {results['model']}. Temperature {results['temperature']}, {results['max_tokens']} tokens at "
             "most, prompt `i` with seed `1000 + i`.", "",
             "| section | answers | seconds | tokens per forward |", "|---|---:|---:|---:|"]
    for name, s in r["sections"].items():
        tpf = f"{s['tokens_per_forward']:.3f}" if s["tokens_per_forward"] else "-"
        lines.append(f"| {name} | {len(s['texts'])} | {s['seconds']:.1f} | {tpf} |")
    lines += ["", f"**{same} of {len(r['per_prompt'])} prompts: every answer identical** "
                  f"({r['per_prompt'][0]['answers']} answers each: whole, streamed, block size 1, "
                  f"{results['rounds']} rounds of 8 concurrent streams).", "",
              "| prompt | seed | differing answers | text (start) |", "|---|---:|---|---|"]
    for p in r["per_prompt"]:
        start = p["text"][:60].replace("\n", " ").replace("|", "\\|")
        lines.append(f"| {p['prompt'][:50]}... | {p['seed']} | {', '.join(p['differing']) or 'none'} | {start} |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the default model)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--sections", nargs="+", choices=["noise", "serve"], default=["noise", "serve"])
    ap.add_argument("--noise-trials", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/bench_seeds")
    args = ap.parse_args()
    results: dict[str, Any] = {
        "command": "python benchmarks/bench_seeds.py " + " ".join(sys.argv[1:]),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores", "load_before": os.getloadavg()[0],
        "model": str(args.model) if args.model else "clover-smol (default build)", "max_tokens": args.max_tokens,
        "rounds": args.rounds, "temperature": args.temperature}
    print(f"machine: {results['machine']}, load average {results['load_before']:.1f}", flush=True)
    if "noise" in args.sections:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        results["noise"] = noise_cost(49152, args.noise_trials)
        print(f"noise: {results['noise']}", flush=True)
    if "serve" in args.sections:
        with Server(args.model, args.threads, "--max-num-seqs", str(STREAMS)) as server:
            results["run"] = run_all(server.url, args)
    results["load_after"] = os.getloadavg()[0]
    lines = report(results)
    write_results(args.out, results, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
