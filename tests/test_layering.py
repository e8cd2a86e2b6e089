"""Package layering: inference (model, engine, serving, the inference CLI) never imports training code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "clover"
# `clover train` and `clover data` are training's front end; every other module serves inference.
TRAINING_FRONT_ENDS = {PACKAGE / "cli" / "train.py", PACKAGE / "cli" / "data.py"}
INFERENCE = [p for folder in ("model", "ops", "engine", "serving", "cli")
             for p in sorted((PACKAGE / folder).glob("*.py")) if p not in TRAINING_FRONT_ENDS]


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("path", INFERENCE, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_inference_modules_import_nothing_from_training(path: Path) -> None:
    bad = sorted(m for m in imported_modules(path) if m == "clover.training" or m.startswith("clover.training."))
    assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


ABOVE_THE_NETWORK = ("clover.engine", "clover.serving", "clover.cli", "clover.smol", "clover.conversion",
                     "clover.training")
NETWORK = [p for folder in ("model", "ops") for p in sorted((PACKAGE / folder).glob("*.py"))]
# the one import up, inside the function: `model.generate(...)`, the documented entry point, hands over to the engine
ALLOWED_UP = {"model/modeling.py": {"clover.engine", "clover.engine.generate"}}


@pytest.mark.parametrize("path", NETWORK, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_network_imports_nothing_above_it(path: Path) -> None:
    """`ops/` and `model/` are the bottom layers (with config, paths, choices): a cache location, a default model
    or the engine is never reached from them."""
    allowed = ALLOWED_UP.get(str(path.relative_to(PACKAGE)), set())
    bad = sorted(m for m in imported_modules(path) - allowed if m.startswith(ABOVE_THE_NETWORK))
    assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"
