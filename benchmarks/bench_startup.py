"""How long a user waits for the commands of the README's first screen, warm (the default model built, its cost
table measured, the files in the page cache): wall time of whole processes, as a person sees it.

    python benchmarks/bench_startup.py [--rounds 3] [--out benchmarks/results/bench_startup.json]

Rows: `clover --help`; `clover generate --max-new-tokens 8 "Hi"` (import, load the int4 build, prompt, 8 tokens);
the README's prompt at its default 256 tokens; `clover serve` from its start to `/v1/models` answering. Each is run
`--rounds` times, taking turns, and the median is printed with the runs. The first run after setup (cold) is what
`.ci`-style fresh clones measure; run this right after `scripts/setup.sh` for that figure (`--label cold`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from clover.engine.drafts.cost import processor_name

README_PROMPT = "Write a Python function that reverses a string."


def clover() -> list[str]:
    exe = shutil.which("clover", path=str(Path(sys.executable).parent)) or shutil.which("clover")
    if exe is None:
        raise SystemExit("no `clover` command next to this Python or on PATH: run scripts/setup.sh first")
    return [exe]


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return time.perf_counter() - start


def serve_ready() -> float:
    """Seconds from `clover serve`'s start until `/v1/models` answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    proc = subprocess.Popen(clover() + ["serve", "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - start < 600:
            if proc.poll() is not None:
                raise SystemExit(f"clover serve exited with {proc.returncode} before it was ready")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                time.sleep(0.05)
        raise SystemExit("clover serve was not ready within 600 s")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--label", default="warm", help="what state the machine was in (warm, cold)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bench_startup.json")
    args = p.parse_args()
    rows = {
        "clover --help": lambda: timed(clover() + ["--help"]),
        'clover generate --max-new-tokens 8 "Hi"': lambda: timed(clover() + ["generate", "--max-new-tokens", "8",
                                                                              "Hi"]),
        f'clover generate "{README_PROMPT}"': lambda: timed(clover() + ["generate", README_PROMPT]),
        "clover serve, until /v1/models answers": serve_ready,
    }
    runs: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, run in rows.items():
            runs[name].append(run())
    machine = {"cpu": processor_name(), "cores": os.cpu_count()}
    print(f"start-up, {args.label} ({machine['cpu']}, {machine['cores']} cores): wall seconds, median of "
          f"{args.rounds}")
    for name, times in runs.items():
        print(f"  {name:<70} {statistics.median(times):6.2f}  ({', '.join(f'{t:.2f}' for t in times)})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"label": args.label, "machine": machine, "seconds": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
