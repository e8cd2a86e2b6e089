"""clover-smol v2's learning curve: exact decoding's accepted drafts per set, against supervised tokens and CPU-hours.

    python benchmarks/exact_curve.py runs/clover_smol_v2 [runs/other ...] [--every 24] [--limit 16] \
        [--threads 1] [--out benchmarks/results/exact_curve.jsonl] [--plot docs/img/exact_curve.png]

Held-out documents: the prompts of `bench_smol.py`'s sets (chat, code, structured, our BFCL eval split,
`live_simple`; `--limit` each) answered by the int4 base at block size 1 (greedy, at most 128 tokens): the
tokens exact decoding of the int4 build reproduces. They are built once into `--docs` (a run of a minute or two)
and reused. Each checkpoint of each run whose step is a multiple of `--every` (and the newest; step 0 is the
base with no adapter) is measured by `clover.training.acceptance.draft_acceptance` at the run's block size:
per set, the acceptance of drafts 1..B-1, tokens per forward if every forward verified a whole block of drafts
(`tpf`), and as exact decoding pipelines them (`exact_tpf`: a miss leaves the next forward without drafts;
clover.training.acceptance) -- teacher-forced, fp32, one forward per batch of documents. Supervised tokens and CPU-hours come from the run's
`train_log.jsonl` (`cpu_hours`; logs written before it was counted have none). Rows are appended to `--out`
as each checkpoint finishes; a checkpoint already measured with the same settings is skipped.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_smol import prompt_ids, text_sets, tool_sets  # noqa: E402  (benchmarks/, next to this script)
from smol_curve import read_rows  # noqa: E402

from clover.engine import generate  # noqa: E402
from clover.model import CloverForBlockDiffusion  # noqa: E402
from clover.model.quant import quantize  # noqa: E402
from clover.smol import BUILD_ACTIVATIONS, adapted_model, base_dir  # noqa: E402
from clover.tokenizer import eos_token_ids, load_tokenizer  # noqa: E402
from clover.training.acceptance import draft_acceptance  # noqa: E402
from clover.training.config import load_train_config  # noqa: E402

logger = logging.getLogger("exact_curve")
STEP_DIR = re.compile(r"step-(\d+)")
ANSWER_TOKENS = 128
SETTINGS = ("limit", "docs")


def build_documents(path: Path, limit: int, batch_size: int = 8) -> dict[str, list[dict[str, Any]]]:
    """set -> [{"prompt", "answer"}]: the int4 base's greedy answers to the held-out prompts (cached in `path`)."""
    if path.is_file():
        cached = json.loads(path.read_text())
        if cached["limit"] == limit:
            return cached["sets"]
    tokenizer = load_tokenizer(base_dir())
    model = quantize(CloverForBlockDiffusion.from_pretrained(base_dir()).eval(), "int4", activations=BUILD_ACTIVATIONS)
    sets = {**text_sets(limit), **tool_sets(limit)}
    out: dict[str, list[dict[str, Any]]] = {}
    for name, chats in tqdm(sets.items(), desc="answers"):
        prompts = [prompt_ids(tokenizer, chat) for chat, _ in chats]
        out[name] = []
        for i in range(0, len(prompts), batch_size):
            result = generate(model, prompts[i: i + batch_size], max_new_tokens=ANSWER_TOKENS, block_size=1,
                              threshold=1.0)
            out[name] += [{"prompt": p, "answer": a} for p, a in zip(prompts[i: i + batch_size], result.sequences)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"limit": limit, "answer_tokens": ANSWER_TOKENS, "sets": out}) + "\n")
    return out


def checkpoints(run: Path, every: int) -> dict[int, Path | None]:
    """step -> checkpoint directory to measure (0: the base, None)."""
    found = {int(m.group(1)): p for p in (run / "checkpoints").glob("step-*")
             if (m := STEP_DIR.fullmatch(p.name)) and (p / "adapter.safetensors").is_file()}
    chosen: dict[int, Path | None] = {s: p for s, p in found.items() if s % every == 0}
    if found:
        chosen[max(found)] = found[max(found)]
    return {0: None, **dict(sorted(chosen.items()))}


def progress(run: Path) -> dict[int, dict[str, Any]]:
    """step -> the training log's counters at that step."""
    out: dict[int, dict[str, Any]] = {0: {"supervised_tokens": 0, "tokens": 0, "cpu_hours": 0.0}}
    log = run / "train_log.jsonl"
    for line in log.read_text().splitlines() if log.is_file() else []:
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = {k: record.get(k) for k in ("supervised_tokens", "tokens", "cpu_hours")}
    return out


def measure(model: torch.nn.Module, sets: dict[str, list[dict[str, Any]]], block_size: int, eos: int | None,
            max_seq_len: int) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for name, docs in sets.items():
        documents = [(d["prompt"] + d["answer"], [False] * len(d["prompt"]) + [True] * len(d["answer"]),
                      len(d["prompt"])) for d in docs]
        figures = draft_acceptance(model, documents, block_size, eos_token_id=eos, max_seq_len=max_seq_len)
        row[name] = {"tpf": round(figures["tokens_per_forward"], 4),
                     "exact_tpf": round(figures["exact_tokens_per_forward"], 4),
                     "accept": [round(a, 4) for a in figures["accept"]], "blocks": figures["blocks"]}
    return row


def plot(rows: list[dict[str, Any]], output: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k in rows[0] if isinstance(rows[0][k], dict) and "tpf" in rows[0][k]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    for run in sorted({r["run"] for r in rows}):
        mine = sorted((r for r in rows if r["run"] == run), key=lambda r: r["step"])
        for ax, key in zip(axes, ("supervised_tokens", "cpu_hours")):
            points = [r for r in mine if r.get(key) is not None]
            ax.plot([r[key] for r in points], [sum(r[n]["exact_tpf"] for n in names) / len(names) for r in points],
                    "o-", markersize=3, label=f"{Path(run).name}: mean of {len(names)} sets")
    axes[0].set(xlabel="supervised training tokens",
                ylabel="exact mode's tokens per forward (B = 4, estimated)")
    axes[0].xaxis.set_major_formatter(lambda x, _: f"{x / 1000:g}k")
    axes[1].set(xlabel="training CPU-hours", ylabel="exact mode's tokens per forward (B = 4, estimated)")
    for ax in axes:
        ax.axhline(2.0, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="training output directories (checkpoints/, train_log)")
    parser.add_argument("--every", type=int, default=24, help="measure checkpoints whose step is a multiple")
    parser.add_argument("--limit", type=int, default=16, help="prompts per set")
    parser.add_argument("--docs", type=Path, default=Path("data/clover_smol_v2/eval_docs.json"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/exact_curve.jsonl"))
    parser.add_argument("--plot", type=Path, default=None, help="draw the curve from --out into this PNG")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.every < 1:
        parser.error("--every must be >= 1")
    torch.set_num_threads(args.threads)
    sets = build_documents(args.docs, args.limit)
    tokenizer = load_tokenizer(base_dir())
    settings = {"limit": args.limit, "docs": str(args.docs)}
    done = {(r["run"], r["step"]) for r in read_rows(args.out) if all(r.get(k) == settings[k] for k in SETTINGS)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    base: dict[int, dict[str, Any]] = {}  # block size -> the base's figures (step 0 of every run)
    for run in args.runs:
        config = load_train_config(run / "config.yaml")
        counters = progress(run)
        todo = {s: p for s, p in checkpoints(run, args.every).items() if (str(run), s) not in done}
        for step, path in tqdm(todo.items(), desc=run.name):
            if path is None and config.block_size in base:
                figures = base[config.block_size]
            else:
                model = (CloverForBlockDiffusion.from_pretrained(base_dir()) if path is None else
                         adapted_model(path, config.block_size, 1.0)).eval()
                eos = eos_token_ids(model.config, tokenizer)
                figures = measure(model, sets, config.block_size, eos[0] if eos else None, config.max_seq_len)
                if path is None:
                    base[config.block_size] = figures
            row = {"run": str(run), "step": step, **counters.get(step, {}), **settings, **figures}
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            tqdm.write(json.dumps({k: v if not isinstance(v, dict) else v["exact_tpf"] for k, v in row.items()}))
    if args.plot:
        rows = [r for r in read_rows(args.out) if all(r.get(k) == settings[k] for k in SETTINGS)]
        print(plot(rows, args.plot))


if __name__ == "__main__":
    main()
