"""Repetition on held-out prompts: clover-smol (as `clover generate` runs it) with and without DRY and the loop guard.

    python benchmarks/bench_repetition.py [--limit 3] [--tool-limit 4] [--max-new-tokens 128] [--threads 2] [--out F]

Prompts: the README's first prompt, held-out chat and code prompts (recipes/clover_smol/heldout.jsonl), tool-call
prompts (our BFCL eval split) and list prompts (`LIST_PROMPTS`), batch 1, greedy, the int4 build in exact mode. Settings take turns prompt by prompt
(a slow minute of a shared machine hits them alike), all on one engine:

  * `off`           OpenAI's semantics: no DRY, no loop guard
  * `guard`         the loop guard alone (32-token span, 2 earlier copies)
  * `dry-0.8+guard` DRY at llama.cpp's suggested strength (multiplier 0.8, base 1.75, allowed length 2, its
                    breakers) and the loop guard: what `generate` and `chat` ran by default before
  * `dry-2.0+guard` a stronger DRY
  * `dry-0.8-nobreak-a1+guard` DRY 0.8, allowed length 1, no sequence breakers, the prompt in DRY's history, and
                    the loop guard: the default before DRY's history became the answer alone
  * `default`       what `generate` and `chat` run given no option (clover.cli.loading.default_repetition): DRY
                    0.8, allowed length 1, no sequence breakers, DRY's history the answer alone, and the loop guard
  * `dry-2.0-nobreak+guard` a stronger DRY without breakers, allowed length 2

Per set and setting: the share of 4-grams of an answer that already occurred earlier in it (repeated 4-grams), the
answer's mean length in tokens, the share that end by themselves (EOS) and by the loop guard, tokens/s end to end
and tokens per CPU second of the process (a shared machine may pause a process: CPU time is what a setting costs);
for code the share whose Python code blocks parse; for tool calls the share with a well-formed call and BFCL's exact
match. Writes benchmarks/results/bench_repetition.{md,json} (the json with every answer).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_smol import code_parses, prompt_ids, text_sets, tool_quality, tool_sets  # noqa: E402

from clover.cli.generate import token_texts  # noqa: E402
from clover.cli.loading import default_repetition  # noqa: E402
from clover.engine import Engine, RequestOptions  # noqa: E402
from clover.engine.drafts.cost import cost_table  # noqa: E402
from clover.model import CloverForBlockDiffusion  # noqa: E402
from clover.engine.runner import as_runner  # noqa: E402
from clover.smol import clover_smol_dir  # noqa: E402
from clover.tokenizer import eos_token_ids, load_tokenizer  # noqa: E402

README_PROMPT = "Write a Python function that reverses a string."
GUARD = {"loop_guard_span": 32, "loop_guard_repeats": 2}
# list prompts written for this benchmark (not in clover-smol's training prompts): lists are where SmolLM2 loops on
# items a few tokens long, which DRY with llama.cpp's breakers (one after every item's line break) never reaches
LIST_PROMPTS = ["List 20 kinds of fruit, one per line.", "Name 15 programming languages as a bulleted list.",
                "Give me a numbered list of 12 famous scientists.", "List ten things to pack for a beach trip."]
SETTINGS = {
    "off": RequestOptions(),
    "guard": RequestOptions.of(**GUARD),
    "dry-0.8+guard": RequestOptions.of(dry_multiplier=0.8, **GUARD),
    "dry-2.0+guard": RequestOptions.of(dry_multiplier=2.0, **GUARD),
    "dry-0.8-nobreak-a1+guard": RequestOptions.of(dry_multiplier=0.8, dry_allowed_length=1, dry_sequence_breakers=(),
                                               dry_include_prompt=True, **GUARD),
    "dry-2.0-nobreak+guard": RequestOptions.of(dry_multiplier=2.0, dry_sequence_breakers=(), **GUARD),
    "default": RequestOptions.of(**default_repetition()),
}


def repeated_ngrams(tokens: list[int], n: int = 4) -> float:
    """The share of the answer's n-grams that already occurred earlier in it (0 for answers shorter than n)."""
    seen, repeated, grams = set(), 0, 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        repeated += gram in seen
        seen.add(gram)
        grams += 1
    return repeated / grams if grams else 0.0


def run(args: argparse.Namespace, save: Any = None) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    directory = clover_smol_dir("int4")
    tokenizer = load_tokenizer(directory)
    model = CloverForBlockDiffusion.from_pretrained(directory)
    cost_table(as_runner(model))  # as `clover generate` runs: the cached cost table
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
    engine = Engine(model, rule="exact", vocab_limit=len(tokenizer), detokenize=decode,
                    eos_token_ids=eos_token_ids(model.config, tokenizer), token_texts=token_texts(tokenizer))
    sets: dict[str, list[tuple[dict, Any]]] = {"readme": [({"messages": [{"role": "user", "content": README_PROMPT}],
                                                            "tools": None}, None)]}
    # lists early: a run stopped before the end keeps them (results are saved after each set)
    sets |= {"lists": [({"messages": [{"role": "user", "content": p}], "tools": None}, None) for p in LIST_PROMPTS]}
    texts = text_sets(args.limit)
    sets |= {"chat": texts["chat"], "code": texts["code"]}
    sets |= {"tools": tool_sets(args.tool_limit, ("tools_heldout",))["tools_heldout"]}
    for setting in SETTINGS.values():  # first calls build kernels and caches (DRY's breaker table): not timed
        list(engine.run([[1, 2, 3]], 4, setting))

    report: dict[str, Any] = {}
    for name, chats in sets.items():
        prompts = [prompt_ids(tokenizer, chat) for chat, _ in chats]
        runs: dict[str, list[tuple[list[int], dict[str, Any], float, float]]] = {s: [] for s in SETTINGS}
        for ids in prompts:
            for setting, params in SETTINGS.items():  # taking turns
                start, cpu, out, stats = time.perf_counter(), time.process_time(), [], {}
                for piece in engine.run([ids], args.max_new_tokens, params):
                    out += piece.token_ids
                    stats = piece.stats or stats
                runs[setting].append((out, stats, time.perf_counter() - start, time.process_time() - cpu))
        report[name] = {}
        for setting, results in runs.items():
            answers = [decode(r[0]) for r in results]
            row: dict[str, Any] = {
                "prompts": len(results),
                "repeated_4grams": statistics.mean(repeated_ngrams(r[0]) for r in results),
                "tokens": statistics.mean(len(r[0]) for r in results),
                "ended_eos": statistics.mean(r[1]["finish_reason"] == "eos" for r in results),
                "ended_guard": statistics.mean(r[1]["finish_reason"] == "repetition" for r in results),
                "tokens_per_second": sum(len(r[0]) for r in results) / sum(r[2] for r in results),
                "tokens_per_cpu_second": sum(len(r[0]) for r in results) / sum(r[3] for r in results),
            }
            if name in ("code", "readme"):
                row["code_parses"] = statistics.mean(code_parses(a) for a in answers)
            if name == "tools":
                row |= tool_quality(answers, chats)
            row["answers"] = answers  # kept: a figure can be read against the text it counts
            report[name][setting] = row
            print(name, setting, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()
                                  if k != "answers"}, flush=True)
        if save is not None:  # after each set: a long run stopped early keeps what it measured
            save(report)
    return report


def table(report: dict[str, Any]) -> str:
    cols = ["repeated_4grams", "tokens", "ended_eos", "ended_guard", "tokens_per_second", "tokens_per_cpu_second",
            "code_parses",
            "tool_call_well_formed", "tool_call_exact_match"]
    lines = ["| set | setting | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for name, settings in report.items():
        for setting, row in settings.items():
            cells = [f"{row[c]:.3g}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in cols]
            lines.append(f"| {name} ({settings[setting]['prompts']}) | {setting} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=3, help="held-out chat and code prompts each")
    parser.add_argument("--tool-limit", type=int, default=4, help="tool-call prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "bench_repetition")
    args = parser.parse_args()
    machine = f"{platform.processor() or platform.machine()}, {args.threads} threads"
    try:
        machine = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                       if line.startswith("model name")) + f", {args.threads} threads"
    except (OSError, StopIteration):
        pass
    command = ("python benchmarks/bench_repetition.py " + f"--limit {args.limit} --tool-limit {args.tool_limit} "
               f"--max-new-tokens {args.max_new_tokens} --threads {args.threads}")

    def save(report: dict[str, Any]) -> None:
        readme = report.get("readme", {})
        answers = "".join(f"README prompt, `{s}`:\n\n```\n{row['answers'][0]}\n```\n\n" for s, row in readme.items()
                          if s in ("off", "default"))
        md = (f"# bench_repetition\n\n`{command}` on {machine} (a shared machine: other jobs may have been running; "
              f"settings take turns prompt by prompt; tokens per CPU second is the cost a pause does not "
              f"count).\n\n{table(report)}\n\n{answers}")
        write_atomic(args.out.with_suffix(".md"), md)
        write_atomic(args.out.with_suffix(".json"), json.dumps({"command": command, "machine": machine,
                                                                "report": report}, indent=1))

    print(table(run(args, save)))


if __name__ == "__main__":
    main()
