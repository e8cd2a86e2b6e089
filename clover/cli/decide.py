"""`clover decide --schema FORM.json [--model DIR] TEXT`: fill a form (several linked judgments) in one pass.

Prints one JSON object: `values` (valid against the schema), `probabilities` (each field's), `forward_passes`,
and `order` (the fields completed at each step) and `wall_time_s`. The form is a JSON Schema subset
(`clover.engine.form`); decoding is decision decoding (`clover.engine.decision`, docs/decision.md), or with
`--autoregressive` the AR constrained baseline (block size 1, field by field). Either runs on the torch runner or,
with `--runner llamacpp`, on a GGUF exported by `clover export --to gguf` (docs/gguf.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from clover.cli.loading import DTYPES, add_runner_option, load_model


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("decide", help="fill a form (JSON Schema subset) by decision decoding",
                              description="Fill every slot of a form at once, most confident first.")
    p.add_argument("text", nargs="?", help="the context (default: read from stdin)")
    p.add_argument("--schema", required=True, type=Path, help="the form: a JSON Schema file (docs/decision.md)")
    p.add_argument("--model", help="Clover checkpoint directory, or a GGUF file with --runner llamacpp (default: "
                                   "clover-smol)")
    p.add_argument("--threshold", type=float, default=0.9, help="commit every slot at least this confident, in "
                                                                 "(0, 1]; 1.0: one slot per forward")
    p.add_argument("--autoregressive", action="store_true",
                   help="AR constrained decoding instead (block size 1, field by field): the baseline")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch, or llama.cpp's)")
    add_runner_option(p)
    p.set_defaults(func=run, quant="none", ctx=None)  # load_model's options: weights as stored, default KV cells


def run(args: argparse.Namespace) -> int:
    # deferred for start-up time: torch, the engine and the model load only when the command runs
    import torch

    from clover.engine.decision import decide, decide_autoregressive
    from clover.engine.form import parse_form

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        schema = json.loads(args.schema.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--schema {args.schema}: not valid JSON ({exc})") from exc
    form = parse_form(schema)  # a bad form fails before the model loads
    text = args.text
    if text is None:
        if sys.stdin.isatty():
            raise ValueError("no text: give it as an argument or on stdin")
        text = sys.stdin.read()
    model, tokenizer, _ = load_model(args)
    if args.autoregressive:
        result = decide_autoregressive(model, tokenizer, text, form)
    else:
        result = decide(model, tokenizer, text, form, threshold=args.threshold)
    print(json.dumps({**result.to_json(), "order": result.order, "wall_time_s": round(result.wall_time_s, 4)}))
    return 0
