"""The package's maps stay true to the tree: docs/architecture.md's package map names every module under `clover/`,
the "Roles" of `clover.engine` and `clover.serving` name every module of their package, and a module over 450 lines
says at its top why it is one (the "450-line mark" in its docstring).

The map is the code block under "## The package": a line whose first word ends in `/` opens a folder, which holds
the lines indented deeper below it (a nested folder's lines are its own). A module is named when its path from
`clover/` appears anywhere in the map (`ops/woq.py`), or its file name appears in its folder's own lines; a
package's `__init__.py` is named by its folder's line (the top's by `__init__.py` among `clover/`'s own lines).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "clover"
MODULES = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))


def package_map(doc: Path = ROOT / "docs" / "architecture.md") -> str:
    text = doc.read_text(encoding="utf-8")
    start = text.index("## The package\n\n```\n") + len("## The package\n\n```\n")
    return text[start:text.index("```", start)]


def folder_texts(text: str) -> dict[str, str]:
    """Folder path ('' for `clover/`, 'serving/vllm' ...) -> the map's own lines for it (module docstring)."""
    own: dict[str, list[str]] = {}
    stack: list[tuple[int, str]] = []  # the open folders: (indent of their line, path)
    for line in text.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        while stack and indent <= stack[-1][0]:
            stack.pop()
        word = line.split()[0]
        if word.endswith("/") and "/" not in word[:-1]:
            path = "" if word == "clover/" else "/".join(p for p in (stack[-1][1] if stack else "", word[:-1]) if p)
            stack.append((indent, path))
            own.setdefault(path, [])
        if stack:
            own[stack[-1][1]].append(line)
    return {path: "\n".join(lines) for path, lines in own.items()}


def unnamed(modules: list[str], text: str) -> list[str]:
    folders = folder_texts(text)
    missing = []
    for module in modules:
        folder, _, name = module.rpartition("/")
        if name == "__init__.py" and folder:
            named = folder in folders
        else:
            word = re.compile(rf"(?<![\w./]){re.escape(name)}(?!\w)")
            whole = re.compile(rf"(?<![\w./]){re.escape(module)}(?!\w)")
            named = bool(folder and whole.search(text)) or bool(word.search(folders.get(folder, "")))
        if not named:
            missing.append(module)
    return missing


def test_the_package_map_names_every_module() -> None:
    missing = unnamed(MODULES, package_map())
    assert not missing, f"docs/architecture.md's package map does not name {missing}"


def test_a_module_left_out_of_the_map_is_found() -> None:
    text = package_map()
    # a name listed only under another folder does not count for this one (training/config.py is not config.py)
    assert unnamed(["config.py"], text.replace("\n  config.py ", "\n  settings.py ")) == ["config.py"]
    assert unnamed(["serving/vllm/launch.py"], text.replace("launch.py", "start.py")) == ["serving/vllm/launch.py"]
    assert unnamed(["engine/noise.py"], text.replace("noise.py", "the noise")) == ["engine/noise.py"]
    assert unnamed(["engine/noise.py", "serving/vllm/__init__.py"], text) == []


@pytest.mark.parametrize("package", ["engine", "serving"])
def test_the_roles_docstring_names_every_module(package: str) -> None:
    folder = PACKAGE / package
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))) or ""
    roles = doc[doc.index("Roles:"):]
    names = sorted({p.stem for p in folder.glob("*.py")} - {"__init__"}
                   | {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()})
    missing = [n for n in names if f"`{n}`" not in roles]
    assert not missing, f"clover.{package}'s Roles do not name {missing}"


@pytest.mark.parametrize("module", MODULES)
def test_a_module_over_450_lines_says_why_at_its_top(module: str) -> None:
    text = (PACKAGE / module).read_text(encoding="utf-8")
    if text.count("\n") > 450:
        doc = ast.get_docstring(ast.parse(text)) or ""
        assert "450-line mark" in doc, f"clover/{module} has {text.count(chr(10))} lines and does not say why"
