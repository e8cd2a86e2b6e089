"""Training throughput of the block-diffusion objective (random weights, random tokens).

    python benchmarks/bench_train.py                                   # the three presets, fp32 and bf16
    python benchmarks/bench_train.py --presets clover-tiny --steps 5 --json

One optimizer step of `Trainer.train_step` (collate, noise, vectorised BD3 forward + backward with complementary
masks, clipping, AdamW) on `--batch` documents of `--prompt-len` + `--response-len` tokens. Tokens/s counts the
real clean tokens of the documents (prompt + response), the usual training-throughput unit; the model itself
processes about 2 x (clean + noised) = 2 x (P + 2R) positions per document (two copies for the complementary
mask). Figures measured on this project's machines are in docs/training.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from clover.training.config import config_from_dict
from clover.training.trainer import Trainer

PRESETS = ["clover-tiny", "clover-hybrid-small", "clover-smol-135m"]


def documents(n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(n):
        ids = torch.randint(0, vocab - 2, (prompt_len + response_len,), generator=g)
        mask = torch.zeros(prompt_len + response_len, dtype=torch.bool)
        mask[prompt_len:] = True
        docs.append((ids, mask, prompt_len))
    return docs


def bench(preset: str, precision: str, args: argparse.Namespace) -> dict:
    overrides = {"mask_token_id": 0} if preset == "clover-smol-135m" else {}  # the bare preset has no [MASK]
    with tempfile.TemporaryDirectory() as out:
        cfg = config_from_dict(dict(init=preset, model_overrides=overrides, output_dir=out, batch_size=args.batch,
                                    micro_batch_size=args.batch, block_size=args.block_size, precision=precision,
                                    max_steps=args.warmup + args.steps, warmup_steps=0, progress=False,
                                    resume="never", ar_weight=args.ar_weight,
                                    gradient_checkpointing=args.gradient_checkpointing,
                                    max_seq_len=args.prompt_len + args.response_len))
        vocab = 49152 if preset != "clover-tiny" else 256
        docs = documents(args.batch * (args.warmup + args.steps), args.prompt_len, args.response_len, vocab)
        trainer = Trainer(cfg, train_documents=docs)
        for step in range(args.warmup):
            trainer.train_step(step)
        tokens, start = 0.0, time.perf_counter()
        for step in range(args.warmup, args.warmup + args.steps):
            tokens += trainer.train_step(step)["step_tokens"]
        seconds = time.perf_counter() - start
    return {"preset": preset, "precision": precision, "parameters": trainer.model.num_parameters(),
            "tokens_per_s": tokens / seconds, "step_s": seconds / args.steps, "threads": torch.get_num_threads(),
            "batch": args.batch, "prompt_len": args.prompt_len, "response_len": args.response_len,
            "block_size": args.block_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=PRESETS)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--batch", type=int, default=2, help="documents per step")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=96)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--ar-weight", type=float, default=0.0)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.json:
        print(f"{'preset':<22}{'precision':<10}{'params':>12}{'tokens/s':>12}{'s/step':>10}")
    for preset in args.presets:
        for precision in args.precisions:
            r = bench(preset, precision, args)
            if args.json:
                print(json.dumps(r), flush=True)
            else:
                print(f"{preset:<22}{precision:<10}{r['parameters'] / 1e6:>11.1f}M{r['tokens_per_s']:>12.0f}"
                      f"{r['step_s']:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
