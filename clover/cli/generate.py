"""`clover generate [PROMPT] --model DIR`: decode one prompt block by block and print the text as blocks commit.

`--json` prints one JSON object (text and the figures of docs/design.md §6); `--show-steps` draws, on stderr, how each
block fills in: still-masked positions as a placeholder, positions filled in this step highlighted, then the
block as committed (stdout then gets the whole text at the end instead of streaming it, so the two do not
interleave on a terminal). Thin over `clover.engine.stream`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clover.cli.loading import (add_decoding_options, add_repetition_options, add_thinking_budget_option, load_model,
                                repetition_sampling)
from clover.cli.threads import set_threads

if TYPE_CHECKING:
    from clover.engine import Engine, RequestOptions, StepSnapshot, StreamPiece

MASK_GLYPH = "░"


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt, block by block",
                              description="Generate text with a Clover model (block diffusion decoding).")
    p.add_argument("prompt", nargs="?", help="prompt text (default: read from stdin)")
    p.add_argument("--model", help="Clover checkpoint directory, or a .gguf file with --runner llamacpp "
                   "(default: clover-smol)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt as a user turn with the chat template (default: when the model has one; "
                        "--no-chat continues the raw text)")
    p.add_argument("--system", help="system message (chat prompts)")
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                   help="chat prompts: let the model reason in <think>…</think> first, or not (default: the chat "
                        "template's)")
    add_thinking_budget_option(p)
    p.add_argument("--max-new-tokens", type=int, default=256)
    add_decoding_options(p)
    p.add_argument("--tokens-per-step", type=int, default=None, help="k of --rule top_k_per_step")
    p.add_argument("--sub-block-size", type=int, default=None,
                   help="size of --rule sub_blocks (default 8, Fast-dLLM v2's)")
    # unset: the engine's defaults (clover.engine.sampling.SamplingParams: greedy, no cut, no penalty)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=None, help="default 1: no nucleus cut")
    p.add_argument("--top-k", type=int, default=None, help="default 0: off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None, help="default 1: off")
    add_repetition_options(p)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json-schema", type=Path, default=None, metavar="FILE",
                   help="constrain the answer to JSON valid against this JSON Schema (grammar-constrained decoding, in "
                        "exact mode unless --rule says otherwise; docs/structured.md)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and figures")
    p.add_argument("--show-steps", action="store_true", help="draw each block filling in, step by step (stderr)")
    p.set_defaults(func=run)


def _prompt_ids(tokenizer: Any, args: argparse.Namespace) -> list[int]:
    from clover.chat_template import render_chat  # deferred for start-up time: jinja2, for chat prompts only

    text = args.prompt
    if text is None:
        if sys.stdin.isatty():
            raise ValueError("no prompt: give it as an argument or on stdin")
        text = sys.stdin.read()
    if not text:
        raise ValueError("the prompt is empty")
    chat = args.chat if args.chat is not None else bool(getattr(tokenizer, "chat_template", None))
    if chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": text}]
        rendered = render_chat(tokenizer, messages, add_generation_prompt=True, enable_thinking=args.think)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]


def run(args: argparse.Namespace) -> int:
    # deferred for start-up time: torch and the engine load only when the command runs
    from clover.engine import StepSnapshot, StopAwareDetokenizer, StreamPiece

    set_threads(args.threads)
    runner, tokenizer, source = load_model(args)
    ids = _prompt_ids(tokenizer, args)
    engine, options = engine_for(args, runner, tokenizer)
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
    events = engine.run([ids], args.max_new_tokens, options, snapshots=args.show_steps)
    steps = _StepPainter(tokenizer) if args.show_steps else None
    detok = StopAwareDetokenizer(decode, args.stop)
    token_ids, stats = [], {}
    for event in events:
        if isinstance(event, StepSnapshot):
            steps.draw(event)
            continue
        assert isinstance(event, StreamPiece)
        token_ids += event.token_ids
        if event.finished:
            stats = event.stats
        delta = detok.push(event.token_ids, event.finished, stats.get("stop_string"))
        if steps is not None:
            steps.commit(event)
        elif not args.json:
            sys.stdout.write(delta)
            sys.stdout.flush()
    text = detok.text
    if steps is not None and not args.json:
        sys.stdout.write(text)
    if args.json:
        print(json.dumps({"text": text, "token_ids": token_ids, "prompt_tokens": len(ids), **stats,
                          **engine.settings(), "runner": args.runner, "model": str(source),
                          "quantization": _quantization_summary(getattr(runner, "quantization", None))}))
    else:
        sys.stdout.write("\n")
    return 0


def engine_for(args: argparse.Namespace, runner: Any, tokenizer: Any) -> tuple[Engine, RequestOptions]:
    """The engine and request options `generate` decodes with for the parsed `args` on a loaded runner (benchmarks that
    measure `generate`'s path build theirs here too)."""
    # deferred for start-up time: torch and the engine load only when the command runs
    from clover.engine import Engine, RequestOptions
    from clover.engine.constraints.grammar import json_schema_grammar
    from clover.engine.constraints.thinking import thinking_budget
    from clover.tokenizer import eos_token_ids

    grammar = None
    if args.json_schema is not None:
        try:
            schema = json.loads(args.json_schema.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--json-schema {args.json_schema}: not a readable JSON file ({exc})") from exc
        grammar = json_schema_grammar(schema, tokenizer)
        args.rule = args.rule or "exact"  # block decoding cannot follow a grammar
    budget = None if args.thinking_token_budget is None else thinking_budget(args.thinking_token_budget, tokenizer)
    options = RequestOptions.of(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                repetition_penalty=args.repetition_penalty, seed=args.seed, stop=tuple(args.stop),
                                grammar=grammar, thinking_budget=budget, **repetition_sampling(args))
    rule_options = {name: value for name, value in (("k", args.tokens_per_step), ("size", args.sub_block_size))
                    if value is not None} or None
    engine = Engine(runner, args.block_size, args.threshold, args.rule, rule_options,
                    detokenize=lambda t: tokenizer.decode(t, skip_special_tokens=True), vocab_limit=len(tokenizer),
                    eos_token_ids=eos_token_ids(runner.config, tokenizer), token_texts=token_texts(tokenizer))
    return engine, options


def token_texts(tokenizer: Any) -> Any:
    """Every id's text at once, as `detokenize` gives it one id at a time (DRY's sequence breakers read them): the
    fast tokenizer's own decoder, faster than the Python wrapper's per call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    return lambda: [backend.decode([i], skip_special_tokens=True) for i in range(len(tokenizer))]


class _StepPainter:
    """Draws a block after each denoising step on stderr: `░` masked, new tokens highlighted."""

    def __init__(self, tokenizer: Any) -> None:
        from rich.console import Console  # deferred for start-up time: rich, for --show-steps only

        self.console = Console(stderr=True, highlight=False)
        self.tokenizer = tokenizer

    def draw(self, snap: StepSnapshot) -> None:
        from rich.text import Text  # deferred for start-up time: rich, for --show-steps only

        line = Text(f"block {snap.block:>3} step {snap.step:>2} │ ", style="dim")
        for token, new in zip(snap.tokens, snap.new):
            if token is None:
                line.append(MASK_GLYPH, style="dim")
            else:
                line.append(self._show(token), style="bold black on green" if new else "")
            line.append("·", style="dim")
        self.console.print(line)

    def commit(self, piece: StreamPiece) -> None:
        from rich.text import Text  # deferred for start-up time: rich, for --show-steps only

        line = Text(f"block {piece.block:>3} final   │ ", style="dim")
        line.append("".join(self._show(t) for t in piece.token_ids), style="bold")
        if piece.finished:
            line.append(f"  [{piece.finish_reason}]", style="dim")
        self.console.print(line)

    def _show(self, token: int) -> str:
        return self.tokenizer.decode([token]).replace("\n", "⏎").replace("\t", "⇥") or "∅"


def _quantization_summary(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """The runner's quantisation as `--json` reports it: the per-layer low-rank table (one entry per corrected
    layer: 120 for clover-smol's int4 build) as its layer count by rank."""
    if not spec or not spec.get("low_rank"):
        return spec
    ranks = Counter(spec["low_rank"].values())
    return {**spec, "low_rank": {"layers": len(spec["low_rank"]),
                                 "layers_by_rank": {str(rank): n for rank, n in sorted(ranks.items())}}}
