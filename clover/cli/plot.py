"""`clover plot LOG.jsonl [-o out.png]`: training curve (loss and held-out loss against tokens)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("plot", help="plot a training log (train_log.jsonl) as a PNG",
                                   description=__doc__)
    parser.add_argument("log", type=Path, help="train_log.jsonl written by clover train")
    parser.add_argument("-o", "--output", type=Path, default=None, help="PNG path (default: LOG with .png)")
    parser.add_argument("--x", choices=("tokens", "step"), default="tokens", help="x axis (default: tokens)")
    parser.set_defaults(func=run)


def read_log(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"no training log at {path}")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: invalid JSON ({exc})") from None
    if not records:
        raise ValueError(f"{path}: no log records")
    return records


def plot_log(path: Path, output: Path, x: str = "tokens") -> Path:
    """Write a PNG of loss (and eval loss, AR loss when logged) against tokens or steps."""
    import matplotlib  # deferred for start-up time: matplotlib loads only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: after the backend is chosen

    records = read_log(path)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    series = [("loss", "train loss", "-"), ("ar_loss", "AR loss (causal)", ":"), ("eval_loss", "held-out loss", "o-")]
    if any("ar_loss" in r or "kl" in r for r in records):  # the total differs from the diffusion term
        series.insert(1, ("diffusion_loss", "diffusion loss", "--"))
    for key, label, style in series:
        points = [(r[x], r[key]) for r in records if key in r and x in r]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, style, label=label, markersize=3, linewidth=1.2)
    ax.set_xlabel("training tokens" if x == "tokens" else "step")
    ax.set_ylabel("loss (nats)")
    ax.set_title(path.parent.name or str(path))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output)
    plt.close(fig)
    return output


def run(args: argparse.Namespace) -> int:
    output = args.output or args.log.with_suffix(".png")
    print(plot_log(args.log, output, args.x))
    return 0
