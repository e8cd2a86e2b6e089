"""The threads a command runs on: `--threads`, else `$OMP_NUM_THREADS`, else the cores other processes leave free
(clover.cli.threads), read from the kernel's counters less this process's own time."""

from __future__ import annotations

import os

import pytest
import torch

from clover.cli import threads


def proc_stat(*cpus: tuple[int, int]) -> str:
    """`/proc/stat` text with one line per CPU of (busy, idle) ticks (busy as user time)."""
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    lines += [f"cpu{i} {busy} 0 0 {idle} 0 0 0 0 0 0" for i, (busy, idle) in enumerate(cpus)]
    return "\n".join(lines + ["intr 1 2 3", "ctxt 5"]) + "\n"


def self_stat(ticks: int) -> str:
    """`/proc/self/stat` text of a process named with spaces and a parenthesis, `ticks` of user time."""
    return f"42 (my (odd) name) R 1 42 42 0 -1 4194304 10 0 0 0 {ticks} 0 0 0 20 0 3 0 100"


@pytest.mark.parametrize("after, own, free", [
    (proc_stat((100, 0), (0, 100)), 0, 1),     # one core busy with another process
    (proc_stat((100, 0), (100, 0)), 0, 1),     # both busy: still one thread
    (proc_stat((50, 50), (50, 50)), 100, 2),   # the busy time is this process's own
    (proc_stat((0, 100), (70, 30)), 0, 2),     # a burst: less than BUSY_CORE of a core
    (proc_stat((100, 0), (80, 20)), 0, 1),     # 1.8 cores busy
])
def test_the_free_cores_are_the_cores_others_leave_idle(after, own, free):
    before = (proc_stat((0, 0), (0, 0)), self_stat(0))
    assert threads.free_cores_between(before, (after, self_stat(own)), {0, 1}) == free


def test_only_the_cpus_this_process_may_use_count():
    before = (proc_stat((0, 0), (0, 0), (0, 0)), self_stat(0))
    after = (proc_stat((0, 100), (100, 0), (0, 100)), self_stat(0))
    assert threads.free_cores_between(before, after, {0, 2}) == 2
    assert threads.free_cores_between(before, after, {0, 1}) == 1


def test_the_counters_of_this_machine_read():
    if not os.path.exists("/proc/stat"):
        assert threads.free_cores() is None
    else:
        assert 1 <= threads.free_cores(0.02) <= len(os.sched_getaffinity(0))


@pytest.fixture
def torch_threads():
    kept = torch.get_num_threads()
    yield
    torch.set_num_threads(kept)


def test_threads_follow_the_free_cores_unless_chosen(monkeypatch, torch_threads):
    torch.set_num_threads(2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "free_cores", lambda window=0: 1)
    assert threads.set_threads(None) == 1 and torch.get_num_threads() == 1  # a busy core is left alone
    torch.set_num_threads(2)
    assert threads.set_threads(3) == 3  # --threads wins
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.set_threads(None) == 2  # so does the environment
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(threads, "free_cores", lambda window=0: 8)
    assert threads.set_threads(None) == 2  # never more than torch's default
