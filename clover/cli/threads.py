"""How many threads a command runs the model on: `--threads`, else `$OMP_NUM_THREADS`, else the cores other
processes leave free when it starts.

Why not every core: each forward is a chain of parallel regions (torch's intra-op pool, the C++ kernels'
`#pragma omp`), and a region ends when its slowest thread does. A thread that shares its core with another busy
process runs only part of each scheduler slice, so with two threads on two cores and one busy process beside, every
region waits for the descheduled thread (and its sibling spins meanwhile): the decode collapses, where one thread on
the free core keeps most of its speed (`benchmarks/bench_contention.py`, docs/cpu.md "Contention"). Idle, nothing
changes: every core is free, every core is used.

The free cores are read from the kernel's per-CPU counters (`/proc/stat`) over a short window, less this process's
own time (`/proc/self/stat`), over the CPUs this process may run on: the cores other processes' busy time fills are
taken away. Where the counters cannot be read (not Linux) the thread count stays torch's default.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

WINDOW_S = 0.15  # long enough to span several scheduler slices of a busy process, short beside a model's load
# a core counts as taken when other processes use this share of it: a busy process takes ~1.0, a burst of
# short-lived work (a shell, a process exiting) less, and the cost of a wrong guess is not symmetric (a thread too
# few loses 25-30 % idle; a thread too many beside a busy process, most of the speed)
BUSY_CORE = 0.75


def cpu_ticks(stat: str, cpus: set[int]) -> tuple[int, int]:
    """(busy, total) clock ticks summed over `cpus` from the text of `/proc/stat`: idle is `idle` + `iowait`,
    total the first eight fields (guest time is already inside `user`)."""
    busy = total = 0
    for line in stat.splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(f) for f in fields[:8]]
        busy += sum(ticks) - ticks[3] - ticks[4]
        total += sum(ticks)
    return busy, total


def own_ticks(stat: str) -> int:
    """This process's user + system clock ticks (all its threads) from the text of `/proc/self/stat` (fields 14
    and 15; the command name, field 2, may hold spaces: the fields are counted after its closing parenthesis)."""
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def free_cores_between(before: tuple[str, str], after: tuple[str, str], cpus: set[int]) -> int:
    """The cores of `cpus` other processes left free between two readings of (`/proc/stat`, `/proc/self/stat`):
    `len(cpus)` less the cores their busy time fills (`BUSY_CORE` of a core counts as one); at least 1."""
    busy0, total0 = cpu_ticks(before[0], cpus)
    busy1, total1 = cpu_ticks(after[0], cpus)
    per_core = (total1 - total0) / len(cpus)
    if per_core <= 0:
        return len(cpus)
    others = max(0, (busy1 - busy0) - (own_ticks(after[1]) - own_ticks(before[1])))
    return max(1, len(cpus) - int(others / per_core + 1 - BUSY_CORE))


def _read() -> tuple[str, str]:
    with open("/proc/stat") as stat, open("/proc/self/stat") as own:
        return stat.read(), own.read()


def free_cores(window: float = WINDOW_S) -> int | None:
    """The cores this process may use that other processes leave free now (None: the counters cannot be read)."""
    try:
        cpus = os.sched_getaffinity(0)
        before = _read()
        time.sleep(window)
        return free_cores_between(before, _read(), cpus)
    except (OSError, AttributeError, ValueError, IndexError):
        return None


def set_threads(threads: int | None) -> int:
    """Set torch's threads (the llama.cpp runner takes the same count): `threads` (`--threads`), else
    `$OMP_NUM_THREADS`'s (torch read it), else torch's default lowered to the cores free now. Returns the count."""
    import torch  # deferred: a command's parser is built without torch

    if threads:
        torch.set_num_threads(threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        free = free_cores()
        if free is not None and free < torch.get_num_threads():
            logger.info("%d of %d cores are busy with other work: running on %d threads (--threads to choose)",
                        torch.get_num_threads() - free, torch.get_num_threads(), free)
            torch.set_num_threads(free)
    return torch.get_num_threads()
