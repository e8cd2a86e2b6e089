"""Time to first token of `clover generate --runner llamacpp` on a GGUF never seen before, against the same command
once warm: what first use of a file costs (its tokenizer converted, the runner's forward cost measured).

    python benchmarks/bench_gguf_first_use.py --gguf FILE.gguf --threads 2 --repeats 3

Each repeat copies the GGUF to a new file in a new, empty Clover cache (`CLOVER_CACHE`): nothing of it is kept
anywhere, as on a user's first run. The command then runs twice in that cache, "fresh" and "warm"; the time to
first token is from the process's start to the first byte of the streamed answer on its stdout (Python's start-up
and imports included, the same both ways). Greedy, exact mode (the runner's default), a chat prompt, 32 new
tokens; the process's whole time is reported too (a measurement left to the end of the answer shows there).
Results: `benchmarks/results/bench_gguf_first_use.{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def first_token(gguf: Path, cache: Path, threads: int, max_new: int) -> dict[str, float]:
    """Seconds from the process's start to its first byte on stdout, and to its exit."""
    env = {**os.environ, "CLOVER_CACHE": str(cache), "OMP_NUM_THREADS": str(threads)}
    command = [sys.executable, "-m", "clover.cli.main", "generate", "--runner", "llamacpp", "--model", str(gguf),
               "--threads", str(threads), "--max-new-tokens", str(max_new), "--dry-multiplier", "0",
               "--loop-guard", "0", PROMPT]
    start = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(1)
    first = time.perf_counter() - start
    _, err = proc.communicate()
    total = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"clover generate failed: {err.decode()[-2000:]}")
    return {"first_token_s": round(first, 3), "total_s": round(total, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_gguf_first_use")
    args = parser.parse_args()
    runs = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            fresh = Path(tmp) / f"fresh-{i}.gguf"
            shutil.copyfile(args.gguf, fresh)
            cache = Path(tmp) / "cache"
            run = {"fresh": first_token(fresh, cache, args.threads, args.max_new_tokens),
                   "warm": first_token(fresh, cache, args.threads, args.max_new_tokens)}
        runs.append(run)
        print(json.dumps(run), flush=True)
    median = {kind: {k: statistics.median(r[kind][k] for r in runs) for k in runs[0][kind]}
              for kind in ("fresh", "warm")}
    gap = round(median["fresh"]["first_token_s"] - median["warm"]["first_token_s"], 3)
    machine = {"cpu": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                            if line.startswith("model name")), ""), "cores": os.cpu_count(),
               "load_average_at_start": os.getloadavg(), "threads": args.threads}
    report = {"command": " ".join(sys.argv), "machine": machine, "gguf": str(args.gguf), "runs": runs,
              "median": median, "first_token_gap_s": gap}
    lines = [f"Machine: {machine['cpu']} ({machine['cores']} cores), {args.threads} threads. {args.gguf.name}, "
             f"median of {args.repeats}: a fresh copy in an empty cache, then the same warm.", "",
             "| run | first token s | whole command s |", "|---|---|---|"]
    lines += [f"| {kind} | {median[kind]['first_token_s']} | {median[kind]['total_s']} |" for kind in median]
    lines.append(f"\nFresh minus warm, first token: {gap} s.")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
