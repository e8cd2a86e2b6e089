"""`clover serve [--model DIR]`: the OpenAI-compatible HTTP server (docs/serving.md). Thin over
`clover.serving.create_app` + uvicorn.

Binds to 127.0.0.1 by default; with `--api-key` (or `$CLOVER_API_KEY`) every route but `/health` needs
`Authorization: Bearer KEY`. Binding to another address without a key is allowed but logged as a warning.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

from clover.choices import DRAFT_MEMORY, DRAFT_MEMORY_MODES, DRAFT_MEMORY_TOKENS
from clover.cli.loading import add_decoding_options, choose_runner, load_model, model_path
from clover.cli.model_source import locate
from clover.cli.threads import set_threads
from clover.tool_formats import TOOL_FORMATS

logger = logging.getLogger(__name__)
T = TypeVar("T")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve a model over the OpenAI HTTP API",
                              description="OpenAI-compatible server: /v1/chat/completions, /v1/completions, "
                                          "/v1/responses, /v1/models, /health, /metrics.")
    p.add_argument("--model", help="Clover checkpoint directory, or a .gguf file with --runner llamacpp "
                   "(default: clover-smol)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: localhost only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", nargs="+", metavar="KEY",
                   default=[k for k in os.environ.get("CLOVER_API_KEY", "").split(",") if k] or None,
                   help="require `Authorization: Bearer KEY` with one of these keys (default: $CLOVER_API_KEY, "
                        "comma-separated)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model ids clients may send; the first is the one responses carry (default: the directory "
                        "name; the default model: clover-smol and its directory name)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="sequences decoded together")
    p.add_argument("--max-queue", type=int, default=256, help="sequences waiting before the server answers 429")
    p.add_argument("--max-model-len", type=int, default=None, help="context served (default: the model's)")
    add_decoding_options(p)  # --block-size / --threshold: defaults for requests that do not set them
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens per prefill forward; also the prefix cache's grid")
    p.add_argument("--prefix-cache-mb", type=float, default=512.0, help="prefix cache budget in MiB (0: off)")
    p.add_argument("--prefix-snapshot-interval", type=int, default=None,
                   help="hybrid models: recurrent-state snapshots every this many tokens (a multiple of the chunk)")
    p.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body accepted")
    p.add_argument("--chat-template", default=None, metavar="FILE|clover",
                   help="a Jinja chat template file, or 'clover' for Clover's own (default: the checkpoint's own)")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_FORMATS),
                   help="how the model writes tool calls (default: the format its chat template writes)")
    p.add_argument("--responses-store-mb", type=float, default=64.0,
                   help="memory for stored Responses API responses (previous_response_id), least recently used "
                        "evicted first (0: none kept)")
    p.add_argument("--draft-memory", choices=DRAFT_MEMORY_MODES, default=DRAFT_MEMORY,
                   help="exact mode's drafts from earlier answers: one memory per API key (one for all without "
                        "keys), one shared by every client, or none (docs/agents.md)")
    p.add_argument("--draft-memory-tokens", type=int, default=DRAFT_MEMORY_TOKENS,
                   help="answer tokens each drafting memory keeps, oldest answers evicted first (about 250 bytes "
                        "a token: 64 MiB at the default)")
    p.add_argument("--record-requests", default=None, metavar="FILE",
                   help="append every finished sequence (prompt and answer token ids, the engine's figures) to this "
                        "JSON-lines file, for offline analysis (benchmarks/replay_drafts.py); it holds users' text")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--engine", choices=("clover", "vllm"), default="clover",
                   help="clover: Clover's engine (block decoding, exact mode, decision mode); vllm: vLLM's OpenAI "
                        "server on the model's causal path, from the environment scripts/setup_vllm.sh makes; "
                        "flags after `--` go to vLLM (--tensor-parallel-size, --pipeline-parallel-size, "
                        "--data-parallel-size, --enable-expert-parallel, ...): docs/scale.md")
    p.add_argument("engine_args", nargs="*", help=argparse.SUPPRESS)  # after `--`: vLLM's own flags
    p.set_defaults(func=run, defaults=lambda: vars(p.parse_args([])))  # what an option is when not given


def served_model_names(given: list[str] | None, model_name: str | None, source: Path) -> list[str]:
    """The model ids a server answers to, the first one canonical: `--served-model-name`, else `model_name`, what
    `--model` named (a hub id as typed, as vLLM answers to it; a directory's or GGUF file's name); the default model
    (no `--model`) answers to `clover-smol`, its name in the docs, first, and to its directory's (or GGUF export's)
    name (`clover-smol-<checksum>` in the cache)."""
    if given:
        return list(dict.fromkeys(given))
    if model_name is None:
        from clover.smol import NAME  # deferred for start-up time: clover.smol imports torch

        return list(dict.fromkeys([NAME, source.stem if source.suffix == ".gguf" else source.name]))
    return [model_name]


def model_name(args: argparse.Namespace) -> str | None:
    """The name of what `--model` named (after `choose_runner` located it); None for the default model."""
    return None if args.model_source is None else args.model_source.name


def load_on_passing_thread(load: Callable[[], T]) -> T:
    """`load()` run on a thread that ends when it returns, so that the scheduler's thread is the only one whose
    OpenMP pool lives on.

    PyTorch's CPU builds use GNU OpenMP, which keeps a pool of workers for every thread that ran a parallel region,
    and which stops spinning between regions once its workers outnumber the cores: every region then waits on a
    futex wake-up. Loading a model runs parallel copies; loaded on the main thread, its pool stays alive beside the
    scheduler thread's and the served forwards ran slower than `clover generate`'s (docs/serving.md, "Serve against
    generate"). A thread's pool ends with the thread."""
    box: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            box.append(load())
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=target, name="clover-load", daemon=True)  # Ctrl-C during a load exits
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return box[0]


def read_chat_template(arg: str | None) -> str | None:
    """`--chat-template`: None (the checkpoint's own), 'clover' (Clover's), or a Jinja file's text."""
    if arg is None:
        return None
    if arg == "clover":
        from clover.chat_template import CLOVER_CHAT_TEMPLATE  # deferred: jinja is not needed to parse flags

        return CLOVER_CHAT_TEMPLATE
    path = Path(arg)
    if not path.is_file():
        raise SystemExit(f"--chat-template {arg}: no such file (give a Jinja template file, or 'clover')")
    return path.read_text(encoding="utf-8")


def given_options(args: argparse.Namespace) -> frozenset[str]:
    """The options (argparse dests) of a parsed `clover serve` command line set to other than their defaults."""
    defaults = args.defaults()
    return frozenset(k for k, v in defaults.items() if k not in ("func", "defaults") and getattr(args, k) != v)


def run(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        from clover.serving.vllm.launch import exec_vllm  # deferred: the launcher, for --engine vllm only

        located = None if args.model is None else locate(args.model)
        source = model_path(located, "checkpoint")  # vLLM takes the unquantised checkpoint
        exec_vllm(source, served_model_names(args.served_model_name, located and located.name, source), args,
                  given_options(args))
    if args.engine_args:
        raise ValueError(f"flags after `--` ({' '.join(args.engine_args)}) are vLLM's: add --engine vllm")
    # deferred for start-up time: torch, the engine and the server load only when the command runs
    import torch
    import uvicorn

    from clover.serving import ServerOptions, create_app
    from clover.serving.served_model import read_generation_defaults

    set_threads(args.threads)
    # the default device: a GPU when there is one and the runner runs there
    device = args.device or ("cuda" if "cuda" in choose_runner(args).devices and torch.cuda.is_available()
                             else "cpu")
    runner, tokenizer, source = load_on_passing_thread(lambda: load_model(args, device=device, max_rows=None))
    max_running, rows = args.max_num_seqs, runner.max_rows
    if rows is not None and rows < max_running:
        logger.info("--max-num-seqs %d: the %s runner holds %d sequences at once", max_running, args.runner, rows)
        max_running = rows
    names = served_model_names(args.served_model_name, model_name(args), source)
    options = ServerOptions(
        served_model_name=names[0], model_aliases=tuple(names[1:]), api_key=tuple(args.api_key or ()),
        max_running=max_running, max_waiting=args.max_queue, max_body_bytes=int(args.max_body_mb * 2**20),
        max_model_len=args.max_model_len, block_size=args.block_size, threshold=args.threshold, rule=args.rule,
        prefill_chunk=args.prefill_chunk, prefix_cache_bytes=int(args.prefix_cache_mb * 2**20),
        prefix_snapshot_interval=args.prefix_snapshot_interval, chat_template=read_chat_template(args.chat_template),
        tool_call_parser=args.tool_call_parser, responses_store_bytes=int(args.responses_store_mb * 2**20),
        draft_memory=args.draft_memory,
        draft_memory_tokens=args.draft_memory_tokens,
        record_requests=args.record_requests)
    defaults = read_generation_defaults(source if source.is_dir() else None)
    app = create_app(runner, tokenizer, options, generation_defaults=defaults)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not options.api_keys:
        logger.warning("serving on %s without --api-key: anyone who can reach this address can use the model",
                       args.host)
    logger.info("serving %s as %s on http://%s:%d (%s runner, %s)", source, " or ".join(map(repr, names)), args.host,
                args.port, args.runner, device)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0
