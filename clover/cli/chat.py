"""`clover chat`: an interactive terminal chat that streams each block as it commits.

Commands at the prompt: `/reset` forgets the conversation, `/exit` (or Ctrl-D) leaves.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from clover.cli.loading import (add_decoding_options, add_repetition_options, add_thinking_budget_option, load_model,
                                repetition_sampling)
from clover.cli.threads import set_threads


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("chat", help="interactive chat in the terminal, streamed block by block")
    p.add_argument("--model", help="Clover checkpoint directory, or a .gguf file with --runner llamacpp "
                   "(default: clover-smol)")
    p.add_argument("--system", help="system message")
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                   help="let the model reason in <think>…</think> first, or not (default: the chat template's)")
    add_thinking_budget_option(p)
    p.add_argument("--max-new-tokens", type=int, default=512)
    add_decoding_options(p)
    # unset: the engine's defaults (clover.engine.sampling.SamplingParams: greedy, no cut)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None, help="default 1: no nucleus cut")
    p.add_argument("--seed", type=int, default=None)
    add_repetition_options(p)
    p.add_argument("--no-stats", action="store_true", help="do not print tokens/forward and tokens/s per reply")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # deferred for start-up time: torch, transformers and the engine load only when the command runs
    from clover.chat_template import render_chat
    from clover.cli.generate import token_texts
    from clover.engine import Engine, RequestOptions, StopAwareDetokenizer, StreamPiece
    from clover.engine.constraints.thinking import thinking_budget
    from clover.tokenizer import eos_token_ids

    set_threads(args.threads)
    model, tokenizer, source = load_model(args)
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
    eos = eos_token_ids(model.config, tokenizer)
    budget = None if args.thinking_token_budget is None else thinking_budget(args.thinking_token_budget, tokenizer)
    options = RequestOptions.of(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                thinking_budget=budget, **repetition_sampling(args))
    engine = Engine(model, args.block_size, args.threshold, args.rule, detokenize=decode, vocab_limit=len(tokenizer),
                    eos_token_ids=eos, token_texts=token_texts(tokenizer))
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict[str, str]] = list(system)
    interactive = sys.stdin.isatty()
    print(f"clover chat — {source.name} (/reset, /exit)", file=sys.stderr)
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            break
        if line.strip() == "/exit":
            break
        if line.strip() == "/reset":
            messages = list(system)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        text = render_chat(tokenizer, messages, add_generation_prompt=True, enable_thinking=args.think)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        detok = StopAwareDetokenizer(decode)
        sys.stdout.write("clover> ")
        stats: dict[str, Any] = {}
        for event in engine.run([ids], args.max_new_tokens, options):
            if isinstance(event, StreamPiece):
                sys.stdout.write(detok.push(event.token_ids, event.finished))
                if event.finished:
                    stats = event.stats or {}
                sys.stdout.flush()
        sys.stdout.write("\n")
        if not args.no_stats:
            print(f"  [{stats.get('tokens', 0)} tokens, {stats.get('tokens_per_forward', 0):.2f} tokens/forward, "
                  f"{stats.get('tokens_per_second', 0):.1f} tokens/s]", file=sys.stderr)
        messages.append({"role": "assistant", "content": detok.text})
    return 0
