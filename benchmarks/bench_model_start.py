"""How long `clover generate --model ORG/NAME` takes to start once its conversion is cached, against the same model
given as its Clover checkpoint: wall time of whole processes, offline (HF_HUB_OFFLINE=1).

    python benchmarks/bench_model_start.py [--rounds 3] [--layers 30] [--out benchmarks/results/bench_model_start.json]

A random Qwen3 of SmolLM2-135M's shape (hidden 576, 9 heads / 3 KV heads, `--layers`, clover-smol's tokenizer) is
saved with transformers' `save_pretrained` into a temporary HF_HOME's hub cache (huggingface_hub's layout) and a
temporary CLOVER_CACHE. Rows: the first start (the conversion into the cache included), then, taking turns for
`--rounds`, a start by hub id (the cached conversion) and a start by the converted checkpoint's directory; each
generates one token (`--max-new-tokens 1 --block-size 1 --rule left_to_right`: the base's own greedy token, with no
exact-mode forward-cost calibration, which both rows would share and which a random model's contradicting timings
can make re-measure at every start; no chat template, fp32 weights). Prints the medians and their ratio.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from clover.engine.drafts.cost import processor_name

REPO = "bench-org/qwen3-smol-shape"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def save_to_hub_cache(hub: Path, repo: str, files: Path, commit: str) -> None:
    """`files` as revision main = `commit` of `repo` in huggingface_hub's cache layout (blobs by sha256, snapshot
    links, refs/main)."""
    storage = hub / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in sorted(files.iterdir()):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
        blob = storage / "blobs" / digest.hexdigest()
        path.rename(blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)


def build_model(staging: Path, layers: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from clover.checkpoint import copy_tokenizer_files
    from clover.cli.loading import resolve_model_dir
    from clover.config import CloverConfig

    smol = resolve_model_dir(None)
    tokens = CloverConfig.from_file(smol)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=tokens.vocab_size, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, num_hidden_layers=layers, intermediate_size=1536, tie_word_embeddings=True,
                         eos_token_id=tokens.eos_token_id, bos_token_id=tokens.bos_token_id)
    Qwen3ForCausalLM(config).save_pretrained(staging)
    copy_tokenizer_files(smol, staging)


def timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, timeout=900)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bench_model_start.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="clover-bench-model-start-") as tmp:
        tmp = Path(tmp)
        build_model(tmp / "staging", args.layers)
        save_to_hub_cache(tmp / "hf" / "hub", REPO, tmp / "staging", COMMIT)
        env = {**os.environ, "HF_HOME": str(tmp / "hf"), "HF_HUB_OFFLINE": "1", "CLOVER_CACHE": str(tmp / "clover")}
        command = [sys.executable, "-m", "clover.cli.main", "generate", "--no-chat", "--threads", str(args.threads),
                   "--max-new-tokens", "1", "--block-size", "1", "--rule", "left_to_right", "--model"]
        first = timed(command + [REPO, "Hi"], env)
        converted = next((tmp / "clover" / "converted").iterdir())
        rows = {f"--model {REPO} (cached conversion)": command + [REPO, "Hi"],
                "--model CLOVER_CHECKPOINT_DIR": command + [str(converted), "Hi"]}
        runs: dict[str, list[float]] = {name: [] for name in rows}
        for _ in range(args.rounds):
            for name, argv in rows.items():
                runs[name].append(timed(argv, env))
    machine = {"cpu": processor_name(), "cores": os.cpu_count()}
    medians = {name: statistics.median(times) for name, times in runs.items()}
    hub, local = medians.values()
    print(f"start of `clover generate --max-new-tokens 1` ({machine['cpu']}, {machine['cores']} cores, "
          f"{args.threads} threads, {args.layers} layers): wall seconds, median of {args.rounds}")
    print(f"  {'first start by hub id (converts into the cache)':<60} {first:6.2f}")
    for name, times in runs.items():
        print(f"  {name:<60} {medians[name]:6.2f}  ({', '.join(f'{t:.2f}' for t in times)})")
    print(f"  hub id / checkpoint: {hub / local:.3f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "layers": args.layers, "threads": args.threads,
                                    "first_start_s": first, "seconds": runs, "ratio": hub / local}, indent=1) + "\n")


if __name__ == "__main__":
    main()
