"""Strict tool calls: the share of tool-call arguments valid against their tool's JSON schema, unconstrained and
under the grammar, on the held-out tool-call sets (bench_smol.py's `tool_sets`: our BFCL eval split and BFCL's
untouched live_simple).

    python benchmarks/bench_strict_tools.py [--model DIR] [--limit 8] [--threads 1] [--max-new-tokens 128]

Each chat (with its tools) is answered by clover-smol at its default decoding (the model's block size, threshold and
rule; greedy, batch 1) three ways, as `clover serve` answers them:
  * `auto`     — as the model answers (`tool_choice: "auto"`): it may answer in text;
  * `required` — the answer forced to start with `<tool_call>` (`tool_choice: "required"`, non-strict tools: forced
                 by prefix only);
  * `strict`   — `tool_choice: "required"` with `strict: true` tools: the call under the grammar
                 (`clover.serving.grammar_route`: exact mode, the arguments constrained to the tool's schema).
Per set and way: `valid` — answers whose every tool call names one of the chat's tools with arguments valid against
its `parameters` (`jsonschema_rs`), over all answers (an answer without a call counts as not valid); `with_call` —
answers with at least one parsed call; `cut` — answers cut by `--max-new-tokens` (an unfinished call has no valid
arguments); `exact_match` — BFCL's AST match against the accepted answers; tokens, forwards and seconds. Prints a
table; `--out` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema_rs
import torch
from bench_smol import Chats, tool_sets  # benchmarks/, next to this script

from clover.assistant_output import CALL, parse_assistant_output
from clover.chat_template import render_chat
from clover.engine import Engine, RequestOptions
from clover.engine.constraints.grammar import tool_call_grammar
from clover.model import CloverForBlockDiffusion
from clover.tool_formats import HERMES
from clover.tokenizer import eos_token_ids, load_tokenizer
from clover.training.bfcl import tool_call_matches

WAYS = ("auto", "required", "strict")


def calls_valid(calls: list[dict[str, Any]], tools: list[dict[str, Any]]) -> bool:
    """Whether there is a call and every call names one of `tools` with arguments valid against its parameters."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if not calls:
        return False
    for call in calls:
        schema = schemas.get(call["function"]["name"])
        try:
            arguments = json.loads(call["function"]["arguments"])
        except json.JSONDecodeError:
            return False
        if schema is None or not jsonschema_rs.is_valid(schema, arguments):
            return False
    return True


def answer(engine: Engine, tokenizer: Any, chat: dict[str, Any], way: str, max_new_tokens: int) -> tuple[str, dict]:
    """The assistant text (a forced start included) and the engine's stats for one chat answered `way`."""
    forced = "" if way == "auto" else CALL + "\n"
    text = render_chat(tokenizer, chat["messages"], chat["tools"], add_generation_prompt=True) + forced
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    grammar = None
    if way == "strict":  # what grammar_route.request_grammar builds for tool_choice="required"
        grammar = tool_call_grammar([(t["function"]["name"], t["function"].get("parameters")) for t in chat["tools"]],
                                    tokenizer, head=HERMES.head, tail=HERMES.tail)
    out, stats = [], {}
    for event in engine.run([ids], max_new_tokens, RequestOptions(grammar=grammar)):
        out += event.token_ids
        stats = event.stats or stats
    return forced + tokenizer.decode(out, skip_special_tokens=True), stats


def measure(engine: Engine, tokenizer: Any, chats: Chats, way: str, max_new_tokens: int) -> dict[str, float]:
    valid, with_call, cut, matches, tokens, forwards, seconds = [], [], [], [], 0, 0, 0.0
    for chat, accepted in chats:
        start = time.perf_counter()
        text, stats = answer(engine, tokenizer, chat, way, max_new_tokens)
        seconds += time.perf_counter() - start
        calls = parse_assistant_output(text)[2]
        valid.append(calls_valid(calls, chat["tools"]))
        with_call.append(bool(calls))
        cut.append(stats["finish_reason"] == "length")
        matches.append(tool_call_matches(calls, accepted))
        tokens += stats["tokens"]
        forwards += stats["forward_passes"]
    return {"answers": len(chats), "valid": statistics.mean(valid), "with_call": statistics.mean(with_call),
            "cut": statistics.mean(cut), "exact_match": statistics.mean(matches), "tokens": tokens,
            "forward_passes": forwards, "seconds": round(seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a Clover checkpoint (default: clover-smol)")
    parser.add_argument("--limit", type=int, default=8, help="chats per set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is None:
        from clover.smol import clover_smol_dir  # deferred: builds the default model on first use
        args.model = clover_smol_dir()
    model = CloverForBlockDiffusion.from_pretrained(args.model).eval()
    tokenizer = load_tokenizer(args.model)
    options = {"eos_token_ids": eos_token_ids(model.config, tokenizer), "vocab_limit": len(tokenizer)}
    engine = Engine(model, **options)
    # a grammar runs in exact mode whatever the default rule (as the server runs it)
    strict = engine if engine.rule.name == "exact" else Engine(model, rule="exact", **options)
    settings = engine.settings()
    print(f"model {args.model.name}: block size {settings['block_size']}, rule {settings['rule']}; "
          f"{torch.get_num_threads()} thread(s); {args.limit} chats per set, max {args.max_new_tokens} new tokens")
    print(f"{'set':18} {'way':9} {'valid':>6} {'w/ call':>8} {'cut':>5} {'match':>6} {'tokens':>7} {'fwd':>5} "
          f"{'s':>7}")
    report: dict[str, dict[str, dict[str, float]]] = {}
    for name, chats in tool_sets(args.limit).items():
        report[name] = {}
        for way in WAYS:
            f = report[name][way] = measure(strict if way == "strict" else engine, tokenizer, chats, way,
                                            args.max_new_tokens)
            print(f"{name:18} {way:9} {f['valid']:6.0%} {f['with_call']:8.0%} {f['cut']:5.0%} "
                  f"{f['exact_match']:6.0%} "
                  f"{f['tokens']:7d} {f['forward_passes']:5d} {f['seconds']:7.1f}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"model": str(args.model), "settings": settings, "limit": args.limit,
                                        "figures": report}, indent=2) + "\n")


if __name__ == "__main__":
    main()
