"""`clover decide --schema FILE [--model DIR] TEXT`: answer with JSON valid against a schema, a form in one pass.

Prints one JSON object: `values` (valid against the schema), `path` and what it cost. The schema is routed as the
server routes `response_format` (docs/structured.md):
  * a form, inside decision mode's subset (`clover.engine.constraints.form`: a flat object of enum / boolean /
    bounded integer / bounded string fields): decision decoding (`clover.engine.loops.decision`, docs/decision.md),
    all slots at once; also `probabilities` (each field's), `forward_passes` and `order` (the fields completed at
    each step); with `--autoregressive` the AR constrained baseline (block size 1, field by field);
  * any other JSON Schema: grammar-constrained decoding (`clover.engine.constraints.grammar`) in exact mode after
    the same prompt (the schema in a system turn), i.e. constrained block-size-1 greedy output; also `tokens`,
    `forward_passes` and `forced_tokens` (decided with no forward).
Either runs on the torch runner or, with `--runner llamacpp`, on a GGUF exported by `clover export --to gguf`
(docs/gguf.md). `--json-schema` is another name for `--schema` (as `clover generate --json-schema`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from clover.cli.loading import DTYPES, add_runner_option, load_model
from clover.cli.threads import set_threads


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("decide", help="answer with JSON valid against a schema (a form: by decision decoding)",
                              description="Answer with JSON valid against a schema: a form (decision mode's subset) "
                                          "fills every slot at once, most confident first; any other schema is "
                                          "decoded under its grammar.")
    p.add_argument("text", nargs="?", help="the context (default: read from stdin)")
    p.add_argument("--schema", "--json-schema", dest="schema", required=True, type=Path,
                   help="a JSON Schema file: a form (docs/decision.md) is decided, any other schema decoded under its "
                        "grammar (docs/structured.md)")
    p.add_argument("--model", help="Clover checkpoint directory, or a GGUF file with --runner llamacpp (default: "
                                   "clover-smol)")
    p.add_argument("--threshold", type=float, default=0.9, help="commit every slot at least this confident, in "
                                                                 "(0, 1]; 1.0: one slot per forward")
    p.add_argument("--autoregressive", action="store_true",
                   help="AR constrained decoding instead (block size 1, field by field): the baseline")
    p.add_argument("--max-new-tokens", type=int, default=512,
                   help="a schema outside the form subset: the most tokens its answer may take")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch, or llama.cpp's)")
    add_runner_option(p)
    p.set_defaults(func=run, quant="none", ctx=None)  # load_model's options: weights as stored, default KV cells


def run(args: argparse.Namespace) -> int:
    # deferred for start-up time: torch, the engine and the model load only when the command runs
    from clover.engine.loops.decision import decide, decide_autoregressive
    from clover.engine.constraints.form import FormError, parse_form

    set_threads(args.threads)
    try:
        schema = json.loads(args.schema.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--schema {args.schema}: not valid JSON ({exc})") from exc
    try:
        form = parse_form(schema)
    except FormError as exc:  # not a form: the grammar path (as the server routes response_format)
        if args.autoregressive:
            raise ValueError(f"--autoregressive is decision mode's baseline, for a form; --schema {args.schema} is "
                             f"outside the form subset ({exc}), so it is decoded under its grammar, whose output is "
                             "constrained block-size-1 decoding already: leave --autoregressive out") from exc
        form = None
    text = args.text
    if text is None:
        if sys.stdin.isatty():
            raise ValueError("no text: give it as an argument or on stdin")
        text = sys.stdin.read()
    model, tokenizer, _ = load_model(args)
    if form is None:
        print(json.dumps(_by_grammar(model, tokenizer, text, schema, args.max_new_tokens)))
        return 0
    if args.autoregressive:
        result = decide_autoregressive(model, tokenizer, text, form)
    else:
        result = decide(model, tokenizer, text, form, threshold=args.threshold)
    print(json.dumps({**result.to_json(), "path": "decision", "order": result.order,
                      "wall_time_s": round(result.wall_time_s, 4)}))
    return 0


def _by_grammar(runner: Any, tokenizer: Any, text: str, schema: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    """The answer to a schema outside the form subset: exact mode under its grammar, after decision mode's prompt."""
    # deferred for start-up time: the engine loads only when the command runs
    from clover.engine import Engine, RequestOptions
    from clover.engine.loops.decision import render_prompt
    from clover.engine.constraints.grammar import json_schema_grammar
    from clover.tokenizer import eos_token_ids

    grammar = json_schema_grammar(schema, tokenizer)  # GrammarError (a ValueError) names what it cannot enforce
    engine = Engine(runner, rule="exact", eos_token_ids=eos_token_ids(runner.config, tokenizer),
                    vocab_limit=len(tokenizer))
    tokens, stats = [], {}
    for event in engine.run([render_prompt(tokenizer, text, schema)], max_new_tokens, RequestOptions(grammar=grammar)):
        tokens += event.token_ids
        stats = event.stats or stats
    if stats["finish_reason"] != "eos":
        raise ValueError(f"the answer did not complete within --max-new-tokens {max_new_tokens}: raise it")
    return {"values": json.loads(tokenizer.decode(tokens, skip_special_tokens=True)), "path": "grammar",
            "tokens": stats["tokens"], "forward_passes": stats["forward_passes"],
            "forced_tokens": stats.get("forced_tokens", 0), "wall_time_s": round(stats["wall_time_s"], 4)}
