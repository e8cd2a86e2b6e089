"""A server the benchmark starts itself: a subprocess on a free loopback port, waited for (bounded) until a health
path answers 200, and always stopped (on exit, on an error, on Ctrl-C; a benchmark that turns SIGTERM into an
exception gets the same). bench_agent.py runs every system through it (`clover serve`, llama.cpp's server),
bench_exact.py its llama.cpp server systems (benchmarks/llama_server.py).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`argv(port)` in a subprocess on a free loopback port, its output in `log`, `OMP_NUM_THREADS=threads` and this
    checkout on `PYTHONPATH`. As a context manager: entered once `health` answers 200 (or raises, naming the log,
    when the process exits first or `startup_s` passes), stopped on exit."""

    def __init__(self, name: str, argv: Callable[[int], list[str]], log: Path, *, threads: int,
                 health: str = "/health", startup_s: float = 600.0) -> None:
        self.name, self.health, self.startup_s, self.port = name, health, startup_s, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv(self.port), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def peak_rss_mib(self) -> float | None:
        """Peak resident memory of the server process (VmHWM, Linux)."""
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return None
        found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
        return int(found[1]) / 1024 if found else None

    def __enter__(self) -> "ServerProcess":
        deadline = time.monotonic() + self.startup_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                       f"{self.log.read_text(errors='replace')[-2000:]}")
                try:
                    if httpx.get(self.url + self.health, timeout=5).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} not healthy after {self.startup_s:.0f} s (log: {self.log})")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
