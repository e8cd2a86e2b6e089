"""`clover serve --record-requests FILE`: every finished sequence as one JSON line, for offline analysis.

A line holds the prompt's and the answer's token ids, in the order the server finished them, the seed its sampled
tokens were keyed by (drawn by the engine when the request gave none; null when greedy), with the engine's figures
for the answer (forwards, drafts accepted by source, finish reason): what `benchmarks/replay_drafts.py`
replays to predict what a drafting policy would have accepted, beside what the server measured. Prompts and
answers are the users' text: the file is written with owner-only permissions, and only when asked for.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from clover.engine.request import Sequence


class RequestLog:
    """Appends one line per finished sequence to `path` (owner-only: created so, and an existing file made so; a
    symlink at `path` is refused with OSError, ELOOP), flushed at once: the server may be killed, and the
    process's exit closes the file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)  # the mode given to open applies to a new file only
        except OSError:
            os.close(fd)
            raise
        self._file = os.fdopen(fd, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, seq: Sequence, stats: dict[str, Any]) -> None:
        line = json.dumps({"time": time.time(), "prompt": seq.prompt, "answer": seq.generated,
                           "seed": seq.options.sampling.seed,
                           "stats": {k: v for k, v in stats.items() if k != "steps_per_block"}})
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
