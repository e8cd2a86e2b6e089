"""Every script of the repository imports: a module moved or renamed inside the package breaks the scripts that
use it here, not months later in a user's hands."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from script_helpers import ROOT, load_script

SCRIPTS = sorted(p for folder in ("benchmarks", "recipes/clover_smol", "examples") for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_script_imports(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(path.parent))  # scripts import their neighbours (bench_smol, code_sandbox, ...)
    load_script(path, f"_script_{path.stem}")
    sys.modules.pop(f"_script_{path.stem}", None)
