"""Shared by the vLLM tests: the environment scripts/setup_vllm.sh makes, and `clover serve --engine vllm` as a
subprocess (vLLM's OpenAI server on a Clover checkpoint)."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from server_helpers import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("CLOVER_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))

needs_vllm = pytest.mark.skipif(not os.access(VLLM_PYTHON, os.X_OK),
                                reason=f"vLLM's environment is absent ({VLLM_PYTHON}): run scripts/setup_vllm.sh")


@contextmanager
def vllm_server(model_dir: Path | None, log: Path, *args: str, name: str = "clover-test",
                timeout: float = 600.0) -> Iterator[str]:
    """`clover serve --engine vllm` on a free localhost port (a small CPU KV cache) on `model_dir` (None: the
    default model); waits, bounded, for /health; always stopped. `args`: more `clover serve` options, then `--`
    and vLLM's own."""
    port = free_port()
    cmd = [sys.executable, "-m", "clover.cli.main", "serve", "--engine", "vllm",
           *(["--model", str(model_dir)] if model_dir else []), "--port", str(port), "--served-model-name", name,
           "--max-num-seqs", "16", "--max-model-len", "1024", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CLOVER_VLLM_PYTHON": str(VLLM_PYTHON), "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log, timeout, "vLLM", poll=1.0)
        yield url
    finally:
        _stop_group(proc)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (vLLM's engine runs in child processes of its own), SIGKILL if it
    lingers."""
    for sig, wait in ((15, 30), (9, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the group is gone
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def greedy_matches(got: list[int], want: list[int], eos: int | list[int] | None) -> bool:
    """vLLM's token ids against Clover's `generate` (which leaves EOS and what follows out): equal, or equal with
    the EOS vLLM stopped at."""
    stops = set([eos] if isinstance(eos, int) else eos or [])
    return got == want or (got[:-1] == want and got[-1:] and got[-1] in stops)
