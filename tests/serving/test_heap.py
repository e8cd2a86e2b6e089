"""The server gives freed C-heap memory back to the system when it goes idle."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import platform
import time
from pathlib import Path

import pytest

import clover.serving.scheduling.scheduler as scheduler_module
from clover.engine import SamplingParams
from clover.serving.scheduling.heap import release_free_heap
from clover.serving.scheduling.scheduler import Scheduler
from model_helpers import tiny_model

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="malloc_trim is glibc's")


def _rss_mib() -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(l for l in status.splitlines() if l.startswith("VmRSS")).split()[1]) / 1024


@glibc
def test_freed_heap_blocks_held_below_a_live_one_go_back_to_the_system():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 96 * 1024, 640  # below the mmap threshold: heap blocks, 60 MiB in all
    blocks = [libc.malloc(size) for _ in range(count)]
    for b in blocks:
        ctypes.memset(b, 1, size)  # resident
    for b in blocks[:-1]:
        libc.free(b)  # the last one stays live above them: free() alone cannot shrink the heap
    before = _rss_mib()
    assert release_free_heap()
    after = _rss_mib()
    libc.free(blocks[-1])
    assert before - after > 40, (before, after)


def test_the_scheduler_releases_the_heap_only_when_idle(monkeypatch):
    calls = []
    sched = Scheduler(tiny_model("clover-tiny-dense"), block_size=4, threshold=0.5, eos_token_ids=[],
                      prefill_chunk=8)
    monkeypatch.setattr(scheduler_module, "release_free_heap",
                        lambda: calls.append((sched.policy.busy(), sched._outstanding)))
    sched.start()

    async def run():
        handle = await sched.submit(list(range(5, 30)), 12, [SamplingParams()])
        return [out async for out in handle]

    try:
        asyncio.run(run())
        for _ in range(100):  # the release follows the step that finished the request
            if calls:
                break
            time.sleep(0.01)
    finally:
        sched.stop()
    assert calls, "the scheduler never released the heap after its last request"
    assert all(not busy for busy, _ in calls)
