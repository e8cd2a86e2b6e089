"""lm-evaluation-harness against `clover serve`: its `local-completions` model on a small generation task.

    python benchmarks/bench_lm_eval.py [--model DIR] [--limit 40] [--fewshot 3] [--out benchmarks/results/bench_lm_eval]

Needs `pip install lm-eval` (not a project dependency: the harness pulls datasets, pandas, scikit-learn, ...).
The task is written here, so nothing is downloaded: `clover_arith`, additions of a one-digit number to a two-digit one
("Question: What is 37 plus 4?\\nAnswer:"), generated until a line break (`generate_until`, greedy, at most 8 tokens) and scored
by exact match against the sum, with `--fewshot` solved examples first. The harness sends each prompt as text to
`/v1/completions` (`tokenized_requests=False`), as it would to vLLM or any OpenAI-compatible server. `--model` none:
the default model and build. Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_server import Server, cpu_name, write_results

ROOT = Path(__file__).resolve().parents[1]
TASK = """task: clover_arith
dataset_path: json
dataset_kwargs:
  data_files:
    train: {train}
    test: {test}
training_split: train
test_split: test
fewshot_split: train
output_type: generate_until
doc_to_text: "Question: What is {{{{a}}}} plus {{{{b}}}}?\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
fewshot_delimiter: "\\n\\n"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
filter_list:
  - name: strip
    filter:
      - function: regex
        regex_pattern: "(-?\\\\d+)"
        group_select: 0
      - function: take_first
"""


def write_task(directory: Path, n: int) -> None:
    rng = random.Random(0)
    rows = [{"a": a, "b": b, "answer": str(a + b)} for a, b in ((rng.randrange(10, 100), rng.randrange(1, 10))
                                                                  for _ in range(n + 16))]
    (directory / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:16]))
    (directory / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[16:]))
    (directory / "clover_arith.yaml").write_text(TASK.format(train=directory / "train.jsonl",
                                                             test=directory / "test.jsonl"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the default model)")
    ap.add_argument("--limit", type=int, default=40, help="test questions")
    ap.add_argument("--fewshot", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/bench_lm_eval")
    args = ap.parse_args()
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        sys.exit("bench_lm_eval needs lm-evaluation-harness: pip install lm-eval")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the task's data are local files
    with tempfile.TemporaryDirectory() as tmp, Server(args.model, None, "--log-level", "warning") as server:
        write_task(Path(tmp), args.limit)
        start = time.perf_counter()
        out = lm_eval.simple_evaluate(
            model="local-completions", tasks=["clover_arith"], num_fewshot=args.fewshot,
            task_manager=TaskManager(include_path=tmp),
            model_args=f"model=bench,base_url={server.url}/v1/completions,num_concurrent=1,max_retries=1,"
                       "tokenized_requests=False,tokenizer_backend=None", log_samples=True)
        wall = time.perf_counter() - start
    metrics = out["results"]["clover_arith"]
    score = next(v for k, v in metrics.items() if k.startswith("exact_match,"))
    results: dict[str, Any] = {
        "command": "python benchmarks/bench_lm_eval.py " + " ".join(sys.argv[1:]),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores", "lm_eval": lm_eval.__version__,
        "model": str(args.model) if args.model else "clover-smol (default build)", "questions": args.limit,
        "fewshot": args.fewshot, "exact_match": score, "metrics": metrics, "wall_s": wall,
        "samples": [{"question": s["doc"], "answer": s["resps"][0][0], "scored": s["filtered_resps"][0]}
                    for s in out["samples"]["clover_arith"]]}
    lines = ["# lm-evaluation-harness `local-completions` against `clover serve`", "", f"`{results['command']}`", "",
             f"Machine: {results['machine']}. Model: {results['model']}. lm-eval {results['lm_eval']}.", "",
             "| task | questions | few-shot | exact match | wall (s) |", "|---|---:|---:|---:|---:|",
             f"| clover_arith | {args.limit} | {args.fewshot} | {score:.3f} | {wall:.1f} |", "",
             "First answers (question, the server's text, what was scored):", "",
             *[f"- {s['question']['a']} + {s['question']['b']}: {s['answer']!r} -> {s['scored']!r}"
               for s in results["samples"][:5]], ""]
    write_results(args.out, results, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
