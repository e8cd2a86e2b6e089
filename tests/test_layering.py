"""Package layering: imports only go down the stated order, and no module imports itself back: at import time, nor
through imports in functions or for type checking (but for the circles `PENDING_CIRCLES` names, each to be cut).

The order (a unit is a top-level module or subpackage of `clover`; a unit may import its own modules and any unit of
a lower layer, never one of its own layer or above):

    paths, choices, atomic_files    where caches live; names the CLI offers; whole-or-nothing writes (import nothing)
    config
    checkpoint, tokenizer, assistant_output
    chat_template
    ops                             the math on tensors
    engine                          decoding, on any module with Clover's forward signature or any runner: it owns
                                    the runner interface (`engine.runner`) and imports no model
    model                           the network and its cache (`model.generate` hands itself to the engine)
    conversion                      other checkpoint formats -> Clover checkpoints (and GGUF export)
    runners                         what runs the network: torch, llama.cpp (a GGUF: conversion reads it)
    training, smol                  training; the default model (built from conversion and model)
    serving
    cli
    __init__                        the package's facade (`clover.CloverForBlockDiffusion`, `clover.decide`)

Inside the engine and the server, their parts (a module or subpackage) keep an order of their own by the same rule,
`INNER_LAYERS`: the engine's runner interface below all its other parts, its constraints, drafts and sampling below
the request, the request below the loops, the loops below the engine; the server's wire formats (`api`) below the
scheduling, the scheduling below the served model, the served model below the routes' flows.

Inference never imports training (checked on its own below, as the server and the CLI sit above training).
"""

from __future__ import annotations

import ast
import io
import shutil
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "clover"
LAYERS: list[tuple[str, ...]] = [
    ("paths", "choices", "atomic_files", "tool_formats"), ("config",), ("checkpoint", "tokenizer", "assistant_output"),
    ("chat_template",), ("ops",), ("engine",),
    ("model",), ("conversion",), ("runners",), ("training", "smol"), ("serving",), ("cli",), ("__init__",),
]
# circles through function-level imports still to be cut (remove an entry once its circle is gone); none is left:
# the runner takes `forward(..., prompt=True)` where the engine set the model's ContextVar, the loops type their engine
# as `LoopEngine` (clover.engine.loops.loop), and `quant` marks fused layers without importing `fused` or `modeling`
PENDING_CIRCLES: list[set[str]] = []
# the parts of a unit, in the same form as LAYERS (a part is a module or subpackage of the unit's folder)
INNER_LAYERS: dict[str, list[tuple[str, ...]]] = {
    "engine": [("runner",), ("constraints", "drafts", "noise", "logprobs", "decoding", "detokenizer", "prefill"),
               ("sampling", "reference"), ("request",), ("loops",), ("engine",), ("__init__",)],
    "serving": [("api", "metrics", "request_log", "locked_tokenizer", "response_store", "vllm"),
                ("request_context", "scheduling"), ("draft_memories", "grammar_route", "structured"),
                ("served_model",), ("chat", "completions", "middleware"), ("responses",), ("app",), ("__init__",)],
}
# `clover train` and `clover data` are training's front end; every other module serves inference.
TRAINING_FRONT_ENDS = {"clover.cli.train", "clover.cli.data"}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path, import_time_only: bool = False) -> set[str]:
    """The `clover.*` modules (and `module.name` forms of `from module import name`) `path` imports; with
    `import_time_only`, only those run when it is imported (not in functions, not under `if TYPE_CHECKING`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = list(ast.walk(tree))
    if import_time_only:
        nodes, todo = [], list(tree.body)
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                todo += node.orelse
                continue
            nodes.append(node)
            todo += list(ast.iter_child_nodes(node))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n == "clover" or n.startswith("clover.")}


def upward_imports(root: Path = PACKAGE, layers: list[tuple[str, ...]] = LAYERS) -> list[str]:
    """Every import of a unit of the same or a higher layer (but the unit itself), as 'module -> module'."""
    rank = {u: i for i, layer in enumerate(layers) for u in layer}
    bad = []
    for path in sorted(root.rglob("*.py")):
        src = module_name(path, root)
        if unit(src) not in rank:
            bad.append(f"{src}: its unit {unit(src)!r} has no place in the order")
            continue
        for dst in sorted(imports(path)):
            if unit(dst) != unit(src) and rank.get(unit(dst), len(layers)) >= rank[unit(src)]:
                bad.append(f"{src} -> {dst}")
    return bad


def inner_upward_imports(package: str, layers: list[tuple[str, ...]], root: Path = PACKAGE) -> list[str]:
    """As `upward_imports`, among the parts of the unit `package` (an import of the package itself, or of a name its
    `__init__` holds, is an import of its `__init__` part)."""
    rank = {u: i for i, layer in enumerate(layers) for u in layer}

    def part(module: str) -> str:
        parts = module.split(".")
        return parts[2] if len(parts) > 2 and parts[2] in rank else "__init__"

    bad = []
    for path in sorted((root / package).rglob("*.py")):
        src = module_name(path, root)
        own = src.split(".")[2:3]
        if own and own[0] not in rank:
            bad.append(f"{src}: its part {own[0]!r} has no place in {package}'s order")
            continue
        for dst in sorted(d for d in imports(path) if d == f"clover.{package}" or d.startswith(f"clover.{package}.")):
            if part(dst) != part(src) and rank[part(dst)] >= rank[part(src)]:
                bad.append(f"{src} -> {dst}")
    return bad


def import_cycles(root: Path = PACKAGE, import_time_only: bool = True) -> list[list[str]]:
    """Cycles among the modules' import-time imports (a cycle there fails or half-initialises a module); with
    `import_time_only` False, among all their imports, in functions and for type checking too (such a cycle ties
    the modules into one unit all the same)."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    graph = {m: {d for d in imports(p, import_time_only=import_time_only) if d in paths and d != m}
             for m, p in paths.items()}
    for m in paths:  # importing a.b.c runs a.b's __init__ first (but a module's own packages are already running)
        ancestors = {".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)}
        parents = {".".join(d.split(".")[:i]) for d in graph[m] for i in range(2, d.count(".") + 1)}
        graph[m] |= (parents & set(paths)) - ancestors - {m}
    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m] & set(paths)):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return cycles


def test_imports_only_go_down_the_order() -> None:
    assert not upward_imports(), "\n".join(upward_imports())


@pytest.mark.parametrize("package", sorted(INNER_LAYERS))
def test_the_parts_of_a_unit_import_only_down_their_order(package: str) -> None:
    bad = inner_upward_imports(package, INNER_LAYERS[package])
    assert not bad, "\n".join(bad)


def test_no_module_imports_itself_back_at_import_time() -> None:
    assert not import_cycles(), "\n".join(" -> ".join(c) for c in import_cycles())


def test_no_module_imports_itself_back_even_in_a_function() -> None:
    cycles = [c for c in import_cycles(import_time_only=False) if not any(set(c) <= p for p in PENDING_CIRCLES)]
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_every_pending_circle_is_still_there() -> None:  # so that a cut circle leaves PENDING_CIRCLES
    found = import_cycles(import_time_only=False)
    assert all(any(set(c) <= p for c in found) for p in PENDING_CIRCLES)


def test_every_unit_is_placed_once() -> None:
    units = [u for layer in LAYERS for u in layer]
    found = {unit(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert len(units) == len(set(units)) and found <= set(units), sorted(found - set(units))


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.rglob("*.py") if unit(module_name(p)) != "training"
                                        and module_name(p) not in TRAINING_FRONT_ENDS),
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_inference_modules_import_nothing_from_training(path: Path) -> None:
    bad = sorted(m for m in imports(path) if unit(m) == "training")
    assert not bad, f"{path.relative_to(PACKAGE)} imports {bad}"


def _plant(tmp_path: Path, relative: str, line: str) -> Path:
    """A copy of the package with `line` added to the file at `relative`."""
    copy = tmp_path / "clover"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    target = copy / relative
    target.write_text(target.read_text(encoding="utf-8") + f"\n{line}\n", encoding="utf-8")
    return copy


@pytest.mark.parametrize("relative, line, found", [
    ("ops/delta_rule.py", "from clover.engine import generate", "clover.ops.delta_rule -> clover.engine"),
    ("runners/registry.py", "    from clover.serving import create_app", "clover.runners.registry -> clover.serving"),
    ("engine/runner.py", "    from clover.model import CloverCache", "clover.engine.runner -> clover.model"),
    ("engine/sampling.py", "import clover.training.data", "clover.engine.sampling -> clover.training.data"),
    ("paths.py", "from clover.config import CloverConfig", "clover.paths -> clover.config"),
])
def test_a_planted_upward_import_is_caught(tmp_path: Path, relative: str, line: str, found: str) -> None:
    if line.startswith(" "):  # an import inside a function counts as much as one at the top
        line = "def _planted():\n" + line
    copy = _plant(tmp_path, relative, line)
    assert found in upward_imports(copy)
    assert not upward_imports(PACKAGE)


@pytest.mark.parametrize("relative, line, found", [
    ("engine/constraints/grammar.py", "from clover.engine.request import Sequence",
     "clover.engine.constraints.grammar -> clover.engine.request"),
    ("serving/api/protocol.py", "from clover.serving import create_app", "clover.serving.api.protocol -> clover.serving"),
])
def test_a_planted_import_up_a_units_parts_is_caught(tmp_path: Path, relative: str, line: str, found: str) -> None:
    package = relative.split("/")[0]
    copy = _plant(tmp_path, relative, line)
    assert found in inner_upward_imports(package, INNER_LAYERS[package], copy)
    assert not inner_upward_imports(package, INNER_LAYERS[package])


def test_a_planted_import_cycle_is_caught(tmp_path: Path) -> None:
    copy = _plant(tmp_path, "engine/sampling.py", "from clover.engine.request import Sequence")
    assert any(set(c) == {"clover.engine.request", "clover.engine.sampling"} for c in import_cycles(copy))
    assert not import_cycles(PACKAGE)


def test_a_planted_cycle_through_a_function_level_import_is_caught(tmp_path: Path) -> None:
    copy = _plant(tmp_path, "serving/scheduling/handles.py",
                  "def _planted():\n    # deferred: a planted cost\n"
                  "    from clover.serving.scheduling.scheduler import Scheduler")
    assert not import_cycles(copy)  # not at import time
    assert any(set(c) == {"clover.serving.scheduling.handles", "clover.serving.scheduling.scheduler"}
               for c in import_cycles(copy, import_time_only=False))


def undeferred_imports(root: Path = PACKAGE) -> list[str]:
    """Imports inside functions that do not say what deferring them saves, as 'file:line: statement'.

    An import runs at a function's call, not the module's import, only where that cuts a real cost (torch for
    `clover --help`, an optional runtime, a heavy library a rare path needs): such an
    import carries a comment starting `deferred` on its line, or just above the run of imports it belongs to."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        comments = {tok.start[0]: tok.string.lstrip("#").strip()
                    for tok in tokenize.generate_tokens(io.StringIO(text).readline) if tok.type == tokenize.COMMENT}

        def said_above(lineno: int) -> bool:  # the comment lines just above `lineno` (a block of them)
            above = lineno - 1
            while above >= 1 and lines[above - 1].lstrip().startswith("#"):
                if comments.get(above, "").startswith("deferred"):
                    return True
                above -= 1
            return False

        def check(body: list[ast.stmt]) -> None:
            run_start = None
            for stmt in body:
                if not isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    run_start = None
                    continue
                run_start = run_start or stmt.lineno
                own = any(comments.get(n, "").startswith("deferred") for n in range(stmt.lineno, stmt.end_lineno + 1))
                if not (own or said_above(run_start)):
                    bad.append(f"{path.relative_to(root.parent)}:{stmt.lineno}: {ast.unparse(stmt)}")

        for func in ast.walk(ast.parse(text)):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(func):
                    for field in ("body", "orelse", "finalbody"):
                        block = getattr(node, field, None)
                        if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                            check(block)
    return sorted(set(bad))


def test_every_function_level_import_says_what_deferring_it_saves() -> None:
    assert not undeferred_imports(), "\n".join(undeferred_imports())


def test_a_planted_undeferred_import_is_caught(tmp_path: Path) -> None:
    copy = _plant(tmp_path, "engine/sampling.py", "def _planted():\n    import json\n\n    return json")
    assert any(b.startswith("clover/engine/sampling.py:") and b.endswith("import json")
               for b in undeferred_imports(copy))
    said = _plant(tmp_path / "said", "engine/sampling.py",
                  "def _planted():\n    # deferred: a planted cost\n    import json\n    import os\n\n"
                  "    return json, os")
    assert not [b for b in undeferred_imports(said) if b.startswith("clover/engine/sampling.py:")]
