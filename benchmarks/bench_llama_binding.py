"""Which llama.cpp binding: the prebuilt library of xllamacpp (through clover/runners/llama_api.py) against
llama-cpp-python built from source, A/B on the same GGUF in one run.

    python benchmarks/bench_llama_binding.py --old-tree DIR [--rounds 3] [--threads 2] [--max-new-tokens 128]
        [--ar-only] [--out benchmarks/results/bench_llama_binding.json]

`--old-tree`: a Clover tree whose llama.cpp runner still runs on llama-cpp-python (main before the switch:
`git archive dd3062c | tar -x -C DIR`), with llama-cpp-python importable in this Python. Each measurement is a
subprocess, the two sides taking turns round by round (a slow minute of a shared machine hits both alike):

* `runner`: `clover generate --runner llamacpp --model Q8_0.gguf --json` (exact mode on clover-smol's q8_0 export,
  Clover's block decoding on llama.cpp's kernels), one warm-up run per side, then its tokens/s per round, and
  whether both sides give the same tokens;
* `ar`: llama.cpp's plain greedy generation of the same prompt ids (old: `llama_cpp.Llama.generate`; new:
  `clover.runners.llamacpp_ar.LlamaCppAR`, what bench_exact's llama systems run), tokens/s after the prompt
  (`--ar-only`: this alone);
* `install`: `pip install --no-deps` of the pinned xllamacpp wheel into a fresh virtual environment (from pip's
  cache when it holds the wheel: say so), and the installed sizes of both libraries.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a Python function that merges two sorted lists into one sorted list."


def _run(cmd: list[str], tree: Path, timeout: float = 900) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:6])}... failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return proc.stdout


def runner_once(tree: Path, gguf: str, args: argparse.Namespace) -> dict:
    out = _run([sys.executable, "-m", "clover.cli.main", "generate", "--runner", "llamacpp", "--model", gguf,
                "--threads", str(args.threads), "--max-new-tokens", str(args.max_new_tokens), "--json", PROMPT],
               tree)
    return json.loads(out.strip().splitlines()[-1])


AR_WORKER = """
import json, sys, time
side, gguf, threads, max_new, ids = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
if side == "old":
    import llama_cpp
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=4096, n_threads=threads, n_batch=512, verbose=False)
    def generate():
        llm.reset()
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            yield token
else:
    from clover.runners.llamacpp_ar import LlamaCppAR
    llm = LlamaCppAR(gguf, threads=threads, n_ctx=4096, n_batch=512)
    def generate():
        return llm.generate(ids, max_new)
def once():
    out, start, first = [], time.perf_counter(), None
    for token in generate():
        if first is None:
            first = time.perf_counter()
        out.append(int(token))
        if len(out) == max_new:
            break
    end = time.perf_counter()
    return out, (len(out) - 1) / (end - first), first - start
once()  # warm-up: first calls allocate
tokens, tps, prefill = once()
print(json.dumps({"tokens": tokens, "decode_tokens_per_second": tps, "prefill_s": prefill}))
"""


def ar_once(tree: Path, side: str, gguf: str, ids: list[int], args: argparse.Namespace) -> dict:
    out = _run([sys.executable, "-c", AR_WORKER, side, gguf, str(args.threads), str(args.max_new_tokens),
                json.dumps(ids)], tree)
    return json.loads(out.strip().splitlines()[-1])


def install_time(args: argparse.Namespace) -> dict:
    """Seconds to create a venv and `pip install --no-deps` the pinned xllamacpp into it."""
    from clover.runners.llama_api import XLLAMACPP_VERSION

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", tmp], check=True)
        pip = [sys.executable, "-m", "pip", "--python", f"{tmp}/bin/python"]
        start = time.perf_counter()
        subprocess.run([*pip, "install", "-q", "--no-deps", f"xllamacpp=={XLLAMACPP_VERSION}"], check=True)
        seconds = time.perf_counter() - start
    return {"xllamacpp_install_s": seconds, "xllamacpp_version": XLLAMACPP_VERSION}


def installed_mib(distribution: str) -> float | None:
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return sum(f.locate().stat().st_size for f in files if f.locate().is_file()) / 2 ** 20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old-tree", type=Path, required=True, help="a Clover checkout on llama-cpp-python")
    p.add_argument("--gguf", help="default: clover-smol's q8_0 export")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--ar-only", action="store_true", help="only llama.cpp's plain generation, not the runner")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_llama_binding.json"))
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from clover.smol import clover_smol_gguf

    gguf = args.gguf or str(clover_smol_gguf("q8_0"))
    trees = {"old": args.old_tree.resolve(), "new": ROOT}
    report: dict = {"command": "python benchmarks/bench_llama_binding.py " + " ".join(sys.argv[1:] if argv is None
                                                                                       else argv),
                    "machine": {"cpu": _cpu(), "cores": os.cpu_count(),
                                "load_average_at_start": os.getloadavg()},
                    "versions": {"llama-cpp-python": _version("llama-cpp-python"), "xllamacpp": _version("xllamacpp")},
                    "installed_MiB": {d: installed_mib(d) for d in ("llama-cpp-python", "xllamacpp")},
                    "gguf": Path(gguf).name, "runner": {"old": [], "new": []}, "ar": {"old": [], "new": []}}
    print(f"{report['versions']}, installed MiB {report['installed_MiB']}", flush=True)
    ids = json.loads(_run([sys.executable, "-c", "import json, sys; from clover.smol import clover_smol_dir; "
                           "from clover.tokenizer import load_tokenizer; t = load_tokenizer(clover_smol_dir()); "
                           "text = t.apply_chat_template([{'role': 'user', 'content': sys.argv[1]}], "
                           "add_generation_prompt=True, tokenize=False); "
                           "print(json.dumps(t(text, add_special_tokens=False)['input_ids']))", PROMPT],
                          ROOT).strip().splitlines()[-1])
    kinds = ("ar",) if args.ar_only else ("runner", "ar")
    for side, tree in trees.items() if "runner" in kinds else ():  # warm-up: the cost table, the tokenizer cache
        runner_once(tree, gguf, args)
    tokens: dict[str, dict[str, list[int]]] = {"runner": {}, "ar": {}}
    for r in range(args.rounds):
        for side, tree in (trees.items() if r % 2 == 0 else reversed(list(trees.items()))):
            if "runner" in kinds:
                res = runner_once(tree, gguf, args)
                report["runner"][side].append(res["tokens_per_second"])
                tokens["runner"][side] = res["token_ids"]
                print(f"round {r} {side}: runner {res['tokens_per_second']:.1f} tok/s (TPF "
                      f"{res['tokens_per_forward']:.2f})", flush=True)
            ar = ar_once(tree, side, gguf, ids, args)
            report["ar"][side].append(ar["decode_tokens_per_second"])
            tokens["ar"][side] = ar["tokens"]
            print(f"round {r} {side}: llama.cpp AR {ar['decode_tokens_per_second']:.1f} tok/s", flush=True)
    for kind in kinds:
        med = {side: statistics.median(v) for side, v in report[kind].items()}
        report[f"{kind}_median_tokens_per_second"] = med
        report[f"{kind}_new_over_old"] = med["new"] / med["old"]
        report[f"{kind}_same_tokens"] = tokens[kind]["old"] == tokens[kind]["new"]
    report["install"] = install_time(args)
    report["load_average_at_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k not in ("runner", "ar")}, indent=1))
    return 0


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
