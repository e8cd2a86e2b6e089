"""clover-smol's learning curve: tokens per forward and quality against training tokens.

    python benchmarks/smol_curve.py runs/clover_smol [--every 40] [--limit 4] [--max-new-tokens 48] \
        [--threads 2] [--out benchmarks/results/smol_curve.jsonl] [--plot docs/img/smol_curve.png]

Evaluates step 0 (the converted base with its `[MASK]` row: no adapter) and every kept checkpoint of an
adaptation run whose step is a multiple of `--every` (and the newest one), with `bench_smol.py`'s prompt sets and
figures: tokens per forward at the run's block size and threshold, agreement with threshold 1.0 (chat, code,
structured), tool-call exact match at both thresholds (our BFCL eval split). Tokens seen and supervised come from
the run's `train_log.jsonl`. Rows are appended to `--out` as each step finishes; a step already measured with the
same settings is skipped, so the script resumes and can be re-run as training goes on. `--plot` draws the curve
from `--out`. Run it as a script from the repository (it imports `bench_smol` from its own folder).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from clover.model import CloverForBlockDiffusion
from clover.smol import adapted_model, base_dir, manifest
from clover.tokenizer import load_tokenizer

from bench_smol import measure, text_sets, tool_sets  # benchmarks/, next to this script

logger = logging.getLogger("smol_curve")
STEP_DIR = re.compile(r"step-(\d+)")
SETTINGS = ("run", "block_size", "threshold", "limit", "max_new_tokens")

TEXT_SETS = ("chat", "code", "structured")


def checkpoints(run: Path, every: int) -> dict[int, Path]:
    """step -> checkpoint directory, for the steps to evaluate (0 is the base)."""
    found = {int(m.group(1)): p for p in (run / "checkpoints").glob("step-*")
             if (m := STEP_DIR.fullmatch(p.name)) and (p / "adapter.safetensors").is_file()}
    if not found:
        logger.warning("no adapter checkpoints (step-N/adapter.safetensors) in %s: only step 0 is measured",
                       run / "checkpoints")
    chosen = {s: p for s, p in found.items() if s % every == 0}
    if found:
        newest = max(found)
        chosen[newest] = found[newest]
    return {0: base_dir(), **dict(sorted(chosen.items()))}


def training_tokens(run: Path) -> dict[int, tuple[int, int]]:
    """step -> (tokens seen, supervised tokens) from the training log."""
    out = {0: (0, 0)}
    log = run / "train_log.jsonl"
    for line in log.read_text().splitlines() if log.is_file() else []:
        record = json.loads(line)
        if "loss" in record and "step" in record:
            out[record["step"]] = (record.get("tokens", 0), record.get("supervised_tokens", 0))
    return out


def summarize(report: dict) -> dict[str, float]:
    row = {f"tpf_{name}": figures["default"]["tokens_per_forward"] for name, figures in report.items()}
    row["agree_exact"] = statistics.mean(report[n]["default"]["agree_exact"] for n in TEXT_SETS if n in report)
    for name in report:
        if name.startswith("tools"):
            row[f"{name}_match"] = report[name]["default"]["tool_call_exact_match"]
            row[f"{name}_match_exact"] = report[name]["exact"]["tool_call_exact_match"]
    return row


def read_rows(path: Path) -> list[dict]:
    """The rows of `--out`; a line cut short by a killed run is skipped (and measured again)."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("skipping an unreadable line of %s: %.60s", path, line)
    return rows


def plot(rows: list[dict], output: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        raise ValueError("no measured rows with training tokens to plot")
    rows = sorted(rows, key=lambda r: r["supervised_tokens"])
    xs = [r["supervised_tokens"] for r in rows]
    keys = sorted(set().union(*rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    for key in (k for k in keys if k.startswith("tpf_")):
        left.plot(xs, [r.get(key) for r in rows], "o-", label=key[4:], markersize=3)
    left.axhline(2.0, color="grey", linestyle=":", linewidth=1)
    left.set(xlabel="supervised training tokens", ylabel="tokens per forward", title="parallelism (default threshold)")
    right.plot(xs, [r["agree_exact"] for r in rows], "o-", label="agreement with threshold 1.0 (text)", markersize=3)
    for key in (k for k in keys if k.endswith("_match")):
        right.plot(xs, [r.get(key) for r in rows], "o-", label=f"{key} (default)", markersize=3)
        right.plot(xs, [r.get(f"{key}_exact") for r in rows], "x--", label=f"{key} (threshold 1.0)", markersize=4)
    right.set(xlabel="supervised training tokens", ylabel="score", title="quality", ylim=(-0.02, 1.02))
    for ax in (left, right):
        ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1000:.0f}k")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="an adaptation run's output_dir (checkpoints/, train_log.jsonl)")
    parser.add_argument("--every", type=int, default=40, help="evaluate checkpoints whose step is a multiple")
    parser.add_argument("--limit", type=int, default=4, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--block-size", type=int, default=None, help="default: clover-smol's (its manifest)")
    parser.add_argument("--threshold", type=float, default=None, help="default: clover-smol's (its manifest)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/smol_curve.jsonl"))
    parser.add_argument("--plot", type=Path, default=None, help="draw the curve from --out into this PNG")
    args = parser.parse_args()
    if args.every < 1:
        parser.error("--every must be >= 1")
    torch.set_num_threads(args.threads)
    block = args.block_size or manifest()["block_size"]
    threshold = args.threshold if args.threshold is not None else manifest()["threshold"]
    settings = {"run": str(args.run.resolve()), "block_size": block, "threshold": threshold, "limit": args.limit,
                "max_new_tokens": args.max_new_tokens}
    done = {r["step"] for r in read_rows(args.out) if all(r.get(k) == v for k, v in settings.items())}
    todo = {s: p for s, p in checkpoints(args.run, args.every).items() if s not in done}
    tokens = training_tokens(args.run)
    tokenizer = load_tokenizer(base_dir())
    sets = {**text_sets(args.limit), **tool_sets(args.limit, ["tools_heldout"])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for step, path in tqdm(todo.items(), desc="checkpoints"):
        if step == 0:
            model = CloverForBlockDiffusion.from_pretrained(path)
        else:
            model = adapted_model(path, block, threshold)
        report = measure(model, tokenizer, sets, {"default": (block, threshold), "exact": (block, 1.0)},
                         args.max_new_tokens, log=tqdm.write)
        seen, supervised = tokens.get(step, (None, None))
        row = {"step": step, "tokens": seen, "supervised_tokens": supervised, **settings, **summarize(report)}
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
        tqdm.write(json.dumps(row))
    if args.plot:
        rows = [r for r in read_rows(args.out) if all(r.get(k) == v for k, v in settings.items())]
        print(plot([r for r in rows if r["supervised_tokens"] is not None], args.plot))


if __name__ == "__main__":
    main()
