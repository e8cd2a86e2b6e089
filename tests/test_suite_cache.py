"""The suite's own Clover cache (tests/conftest.py): the tests and the processes they start never use the user's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from clover.paths import cache_root

ROOT = Path(__file__).resolve().parents[1]


def test_the_suite_and_its_subprocesses_keep_clovers_cache_in_a_temporary_directory(suite_clover_cache,
                                                                                     tmp_path_factory):
    assert cache_root() == suite_clover_cache
    assert suite_clover_cache.is_relative_to(tmp_path_factory.getbasetemp())
    assert not suite_clover_cache.is_relative_to(Path.home())
    seen = subprocess.run([sys.executable, "-c", "from clover.paths import cache_root; print(cache_root())"],
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, check=True)
    assert Path(seen.stdout.strip()) == suite_clover_cache
