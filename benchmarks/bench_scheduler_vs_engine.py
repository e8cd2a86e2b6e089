"""The server's scheduler thread without HTTP against the engine alone, in one process, taking turns.

    python benchmarks/bench_scheduler_vs_engine.py [--model DIR] [--rounds 3] [--max-tokens 128] [--threads N]

One prompt ("Write a Python function that merges two sorted lists into one sorted list."), greedy, the default
model and build unless `--model`: `Engine.run` (what `clover generate` runs) and `Scheduler.submit` consumed by
an asyncio loop (what `clover serve` runs, without HTTP, detokenising or JSON) alternate. Decode rate after the
first piece for both. Tells apart where a served request's time goes: the scheduler thread and its handoffs, or
the HTTP side (`bench_serve_vs_generate.py` measures the whole server). Writes
`benchmarks/results/bench_scheduler_vs_engine.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a Python function that merges two sorted lists into one sorted list."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/bench_scheduler_vs_engine.json")
    args = ap.parse_args()

    import torch

    from bench_server import cpu_name
    from clover.chat_template import render_chat
    from clover.cli.loading import load_model
    from clover.cli.main import build_parser
    from clover.engine import Engine, SamplingParams
    from clover.serving.scheduler import Scheduler
    from clover.tokenizer import eos_token_ids

    flags = [*(["--model", args.model] if args.model else []), *(["--threads", str(args.threads)] if args.threads
                                                                  else [])]
    cli = build_parser().parse_args(["generate", *flags, "x"])
    if args.threads:
        torch.set_num_threads(args.threads)
    runner, tok, source = load_model(cli)
    ids = tok(render_chat(tok, [{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                          enable_thinking=False), add_special_tokens=False)["input_ids"]
    eos = eos_token_ids(runner.config, tok)
    decode = lambda t: tok.decode(t, skip_special_tokens=True)  # noqa: E731
    engine = Engine(runner, detokenize=decode, vocab_limit=len(tok), eos_token_ids=eos)
    scheduler = Scheduler(runner, eos_token_ids=eos, vocab_limit=len(tok), detokenize=decode)
    scheduler.start()

    def rate(pieces: list[tuple[float, int]]) -> float:  # (arrival, tokens) per piece: after the first piece
        return sum(n for _, n in pieces[1:]) / (pieces[-1][0] - pieces[0][0])

    def run_engine() -> float:
        return rate([(time.perf_counter(), len(e.token_ids)) for e in engine.run([ids], args.max_tokens,
                                                                                  SamplingParams())])

    async def run_scheduler() -> float:
        handle = await scheduler.submit(ids, args.max_tokens, [SamplingParams()])
        return rate([(time.perf_counter(), len(out.token_ids)) async for out in handle])

    run_engine(), asyncio.run(run_scheduler())  # warm-up (first-call costs)
    rows = []
    try:
        for r in range(args.rounds):
            order = ("engine", "scheduler") if r % 2 == 0 else ("scheduler", "engine")
            got = {side: run_engine() if side == "engine" else asyncio.run(run_scheduler()) for side in order}
            rows.append(got)
            print(f"round {r}: engine {got['engine']:.1f} tok/s, scheduler {got['scheduler']:.1f} tok/s", flush=True)
    finally:
        scheduler.stop()
    result = {"command": "python benchmarks/bench_scheduler_vs_engine.py " + " ".join(sys.argv[1:]),
              "machine": f"{cpu_name()}, {os.cpu_count()} cores", "load_average": os.getloadavg()[0],
              "model": str(source), "rows": rows,
              "engine_median": statistics.median(r["engine"] for r in rows),
              "scheduler_median": statistics.median(r["scheduler"] for r in rows)}
    result["ratio"] = result["scheduler_median"] / result["engine_median"]
    print(f"median: engine {result['engine_median']:.1f}, scheduler {result['scheduler_median']:.1f} tok/s "
          f"(ratio {result['ratio']:.2f}); load average {result['load_average']:.1f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f"{args.out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
