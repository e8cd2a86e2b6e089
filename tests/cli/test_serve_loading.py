"""`clover serve` loads its model on a thread that ends, so the scheduler thread's OpenMP pool is the only one."""

import subprocess
import sys
import threading

import pytest

from clover.cli.serve import load_on_passing_thread


def test_load_runs_on_another_thread_and_returns_its_value() -> None:
    names = []
    got = load_on_passing_thread(lambda: names.append(threading.current_thread().name) or 42)
    assert got == 42 and names == ["clover-load"]
    assert not any(t.name == "clover-load" for t in threading.enumerate())  # it ended


def test_load_errors_reach_the_caller() -> None:
    def fail() -> None:
        raise FileNotFoundError("no model at /nowhere")

    with pytest.raises(FileNotFoundError, match="/nowhere"):
        load_on_passing_thread(fail)


CHILD = """
import os, time, torch
from clover.cli.serve import load_on_passing_thread
torch.set_num_threads(2)
tasks = lambda: len(os.listdir("/proc/self/task"))
before = tasks()
load_on_passing_thread(lambda: torch.ones(1 << 22).add_(1).sum())  # a parallel region: OpenMP starts a pool
deadline = time.monotonic() + 10  # the pool's workers exit on their own time once its thread has ended
while tasks() > before and time.monotonic() < deadline:
    time.sleep(0.05)
after_passing = tasks()
torch.ones(1 << 22).add_(1).sum()  # the same on the main thread: its pool stays
time.sleep(0.5)
print(before, after_passing, tasks())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads through /proc")
def test_a_passing_threads_openmp_pool_ends_with_it() -> None:
    """Why serve loads this way: the workers a parallel region starts end with the thread that ran it, where those
    of the main thread live on (and, outnumbering the cores beside the scheduler thread's, would slow its forwards)."""
    before, after_passing, after_main = map(int, subprocess.run([sys.executable, "-c", CHILD], check=True,
                                                                 capture_output=True, text=True).stdout.split())
    assert after_passing == before
    assert after_main > before
