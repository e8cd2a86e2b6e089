"""Give the C heap's free memory back to the system when the server has started and whenever it goes idle.

glibc's `malloc` raises its mmap threshold to the size of every large block it frees (up to 32 MiB), so after a
few requests the tensors of a forward (activations, logits, attention scores of long prompts) come from the heap
rather than from mappings of their own, and what they free stays in the process. `malloc_trim(0)` walks every
arena and returns the free pages it finds. The server calls it once after start-up (loading a quantised model and
measuring its forward cost leave ~170 MiB of free heap resident) and whenever its last running request has
finished: the cost (well under a millisecond) is paid between requests, and forwards keep reusing the heap while
requests run.
It gives back part of an agent load's growth, not all (docs/agents.md has the measurement). A no-op where the C
library has no `malloc_trim` (musl, macOS, Windows).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():  # noqa: ANN202 - a ctypes function or None
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_free_heap() -> bool:
    """Return the C heap's free pages to the system; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
