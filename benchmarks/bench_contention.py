"""Decode speed beside other work: the default (`clover generate` on clover-smol, threads left to it) against the same
command on every core (`--threads N`, the default before it chose from the free cores) and llama.cpp's own server
on the q4_0 GGUF of the same model (its threads: every core, its default), idle and beside 1 and 2 busy processes,
in one run.

    python benchmarks/bench_contention.py [--levels 0 1 2 0] [--prompts 3] [--max-new-tokens 128]

A busy process is a single-threaded numpy loop (a 128 x 128 matrix product and tanh, BLAS on one thread) at nice 0,
as a user's other work is; each level starts its busy processes, waits a second, runs every system on every prompt,
then stops them. Each `clover generate` is a fresh process per prompt (it chooses its threads when it starts);
its figure is the decode rate after the first token ((tokens - 1) / (wall - time to first token), greedy, DRY and
loop guard off); llama-server's is its own `predicted_per_second` (a `/completion` request, greedy, no prompt
cache). Figures are medians over the prompts; `kept` is a level's median over the first idle level's, per system.
Run it alone on the machine (under the lock others use): the busy processes must be the only other work.
Writes benchmarks/results/bench_contention.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_server  # noqa: E402
from bench_serve_vs_generate import PROMPTS  # noqa: E402
from bench_server import machine, write_results  # noqa: E402
from server_process import ServerProcess  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BUSY = ("import numpy as np\n"
        "a = np.random.rand(128, 128)\n"
        "while True:\n"
        "    a = np.tanh(a @ a)\n")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def busy_processes(n: int) -> list[subprocess.Popen]:
    env = {**os.environ, **ONE_THREAD}
    return [subprocess.Popen([sys.executable, "-c", BUSY], env=env) for _ in range(n)]


def generate(prompt: str, max_new: int, threads: int | None, chosen: list[int]) -> float:
    """One `clover generate --json` in a fresh process (no `OMP_NUM_THREADS`: the command chooses): its decode
    rate; the threads it ran on appended to `chosen` (its log names them when it took fewer than every core)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "clover.cli.main", "generate", "--json", "--max-new-tokens", str(max_new),
           "--dry-multiplier", "0", "--loop-guard", "0", *(["--threads", str(threads)] if threads else []), prompt]
    done = subprocess.run(cmd, env=env, cwd=ROOT, check=True, capture_output=True, text=True)
    fewer = re.search(r"running on (\d+) threads", done.stderr)
    chosen.append(int(fewer[1]) if fewer else threads or len(os.sched_getaffinity(0)))
    out = json.loads(done.stdout)
    return (out["tokens"] - 1) / (out["wall_time_s"] - out["time_to_first_token_s"])


def llama_decode(client: httpx.Client, ids: list[int], max_new: int) -> float:
    response = client.post("/completion", json=llama_server.completion_request(ids, max_new))
    response.raise_for_status()
    return response.json()["timings"]["predicted_per_second"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", type=int, nargs="+", default=[0, 1, 2, 0], help="busy processes, in order")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "bench_contention")
    args = p.parse_args()
    from clover.chat_template import render_chat
    from clover.smol import clover_smol_dir, clover_smol_gguf
    from clover.tokenizer import load_tokenizer

    cores = len(os.sched_getaffinity(0))
    where = machine()
    prompts = PROMPTS[:args.prompts]
    tokenizer = load_tokenizer(clover_smol_dir("int4"))
    ids = [tokenizer(render_chat(tokenizer, [{"role": "user", "content": q}], add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"] for q in prompts]
    for threads in range(1, cores + 1):  # builds and calibrates what a first run would (not timed)
        generate(prompts[0], 8, threads, [])
    with ExitStack() as stack:
        log = Path(tempfile.gettempdir()) / f"bench_contention-llama-{os.getpid()}.log"
        gguf = clover_smol_gguf("q4_0")
        server = stack.enter_context(ServerProcess(
            "llama-server", lambda port: llama_server.command(gguf, port, alias="bench", ctx=4096, threads=cores),
            log, threads=cores))
        client = stack.enter_context(httpx.Client(base_url=server.url, timeout=600))
        llama_decode(client, ids[0], 8)
        systems: dict[str, Callable[[int], float]] = {
            "clover default": lambda i: generate(prompts[i], args.max_new_tokens, None, chosen),
            f"clover --threads {cores}": lambda i: generate(prompts[i], args.max_new_tokens, cores, chosen),
            f"llama-server ({cores} threads)": lambda i: llama_decode(client, ids[i], args.max_new_tokens),
        }
        rows: list[dict[str, Any]] = []
        for level in args.levels:
            busy = busy_processes(level)
            try:
                time.sleep(1.0)
                for name, run in systems.items():
                    chosen: list[int] = []
                    rates = [run(i) for i in range(len(prompts))]
                    rows.append({"busy": level, "system": name, "tok_s": statistics.median(rates), "runs": rates,
                                 "threads": chosen or [cores] * len(rates)})
                    print(f"busy {level}  {name:28} {rows[-1]['tok_s']:7.1f} tok/s", flush=True)
            finally:
                for proc in busy:
                    proc.kill()
                    proc.wait()
    idle: dict[str, float] = {}
    for r in rows:  # the first idle level's
        if r["busy"] == 0:
            idle.setdefault(r["system"], r["tok_s"])
    for r in rows:
        r["kept"] = r["tok_s"] / idle[r["system"]]
    lines = [f"# bench_contention ({where}; {args.prompts} prompts, {args.max_new_tokens} tokens, levels "
             f"{args.levels})", "", "| busy processes | system | threads per run | decode tok/s (median) | kept of idle |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['busy']} | {r['system']} | {' '.join(map(str, r['threads']))} | {r['tok_s']:.1f} | "
              f"{r['kept']:.2f} |" for r in rows]
    print("\n".join(lines))
    write_results(args.out, {"machine": where, "levels": args.levels, "prompts": prompts,
                             "max_new_tokens": args.max_new_tokens, "rows": rows}, lines)


if __name__ == "__main__":
    main()
