"""Structured outputs: the cost of grammar-constrained decoding against unconstrained decoding, in the same run.

    python benchmarks/bench_structured.py [--model DIR] [--max-new-tokens 128] [--block-size 4]

Each prompt asks for JSON; it is decoded in exact mode unconstrained and then under the JSON Schema (same model,
block size, greedy). Prints tokens/s, tokens per forward and the tokens the grammar forced (each one a token
decided with no forward of its own) per run, and the totals.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

SCHEMA = {"$defs": {"Item": {"type": "object", "properties": {"name": {"type": "string"}, "qty": {"type": "integer"}},
                             "required": ["name", "qty"], "additionalProperties": False}},
          "type": "object", "properties": {
              "customer": {"type": "string"}, "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
              "express": {"type": "boolean"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
          "required": ["customer", "items", "express", "note"], "additionalProperties": False}
PROMPTS = ["Alice orders two apples and a pear, express delivery. Write the order as JSON.",
           "Bob wants 3 notebooks and 1 pen, no rush, note: gift wrap. Give the order as JSON.",
           "Write a JSON order for Carol: five coffees, express."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a Clover checkpoint (default: clover-smol)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    from clover.chat_template import render_chat
    from clover.engine import Engine, RequestOptions
    from clover.engine.constraints.grammar import json_schema_grammar
    from clover.model import CloverForBlockDiffusion
    from clover.tokenizer import eos_token_ids, load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from clover.smol import clover_smol_dir
        args.model = clover_smol_dir()
    model = CloverForBlockDiffusion.from_pretrained(args.model).eval()
    tokenizer = load_tokenizer(args.model)
    start = time.perf_counter()
    grammar = json_schema_grammar(SCHEMA, tokenizer)
    print(f"model {args.model.name}, block size {args.block_size}, {torch.get_num_threads()} threads; "
          f"schema compiled in {1e3 * (time.perf_counter() - start):.0f} ms (tokenizer set-up included)")
    engine = Engine(model, args.block_size, rule="exact", eos_token_ids=eos_token_ids(model.config, tokenizer),
                    vocab_limit=len(tokenizer))
    totals = {name: [0, 0, 0, 0.0] for name in ("free", "grammar")}  # tokens, forwards, forced, seconds
    for text in PROMPTS:
        ids = tokenizer(render_chat(tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True),
                        add_special_tokens=False)["input_ids"]
        for name, params in (("free", RequestOptions()), ("grammar", RequestOptions(grammar=grammar))):
            stats, out = {}, []
            for ev in engine.run([ids], args.max_new_tokens, params):
                out += ev.token_ids
                stats = ev.stats or stats
            forced = stats.get("forced_tokens", 0)
            t = totals[name]
            t[0] += stats["tokens"]
            t[1] += stats["forward_passes"]
            t[2] += forced
            t[3] += stats["wall_time_s"]
            print(f"  {name:<8} {stats['tokens']:4d} tokens  {stats['tokens_per_second']:6.1f} tok/s  "
                  f"TPF {stats['tokens_per_forward']:.2f}  forced {forced:3d}  {stats['finish_reason']:<6} "
                  f"{json.dumps(tokenizer.decode(out, skip_special_tokens=True))[:70]}")
    for name, (tokens, forwards, forced, seconds) in totals.items():
        print(f"{name:<8} {tokens / seconds:6.1f} tok/s  TPF {tokens / forwards:.2f}  forced tokens {forced} "
              f"({forced / max(tokens, 1):.0%} of the tokens: forwards saved)")


if __name__ == "__main__":
    main()
