"""`clover --help`, `clover COMMAND --help` and argument errors answer without importing torch and the rest
(seconds of start-up): the parsers are built from `clover.choices`, each command imports what it runs on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "clover.runners.llama_api", "clover.model", "clover.engine", "clover.serving", "clover.training",
         "clover.conversion", "clover.engine.runner", "clover.runners.torch_runner", "clover.runners.llamacpp")


def imported_modules(*argv: str) -> tuple[int, str, set[str]]:
    """Run `python -X importtime -m clover.cli.main ARGV` on this tree: (exit status, stderr without the
    import-time lines, the modules it imported)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "clover.cli.main", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    modules, errors = set(), []
    for line in proc.stderr.splitlines():
        if line.startswith("import time:"):  # "import time: self [us] | cumulative | imported package"
            modules.add(line.rsplit("|", 1)[1].strip())
        else:
            errors.append(line)
    return proc.returncode, "\n".join(errors), modules


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["serve", "--help"], ["info", "--runners"],
                                  ["generate", "--quant", "int3", "hi"], ["export", "a", "b", "--quant", "q3"]],
                         ids=" ".join)
def test_help_and_argument_errors_do_not_import_torch(argv: list[str]) -> None:
    status, errors, modules = imported_modules(*argv)
    assert "clover.choices" in modules  # this tree ran, with -X importtime
    assert status == (0 if "--help" in argv or "--runners" in argv else 2), errors
    if status:
        assert "invalid choice" in errors
    heavy = [h for h in HEAVY if any(m == h or m.startswith(h + ".") for m in modules)]
    assert not heavy, f"clover {' '.join(argv)} imported {heavy}"


def test_the_rule_names_offered_are_the_registered_rules() -> None:
    """`--rule` offers clover.choices.RULE_NAMES; the engine's registry is filled by the rule classes."""
    from clover.choices import RULE_NAMES
    from clover.engine.decoding import RULES

    assert sorted(RULE_NAMES) == sorted(RULES)


def test_the_runners_offered_are_the_registered_runners(capsys) -> None:
    """`--runner` offers and `clover info --runners` lists the registry's names; each name opens its class."""
    from clover.cli.main import build_parser, main
    from clover.runners import RUNNERS, runner_class

    assert sorted(RUNNERS) == ["llamacpp", "torch"]
    runner_option = next(a for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions
                         if a.dest == "runner")
    assert sorted(runner_option.choices) == sorted(["auto", *RUNNERS])  # auto: by what --model names
    assert main(["info", "--runners", "--json"]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == list(RUNNERS)
    assert {name: runner_class(name).name for name in RUNNERS} == {name: name for name in RUNNERS}


# what `clover generate` must not import: each costs from a tenth of a second to seconds on a small CPU, and a plain
# prompt uses none of them (the grammar engine, transformers, the server, llama.cpp, plotting, training)
NOT_FOR_GENERATE = ("transformers", "llguidance", "torch._dynamo", "fastapi", "uvicorn", "llama_cpp", "xllamacpp",
                    "matplotlib", "clover.serving", "clover.training", "clover.conversion")


def test_generate_imports_only_what_it_runs(tmp_path: Path, chat_tokenizer) -> None:
    from server_helpers import build_checkpoint

    model = build_checkpoint(tmp_path / "model", chat_tokenizer)
    status, errors, modules = imported_modules("generate", "--model", str(model), "--quant", "none", "--threads", "1",
                                               "--max-new-tokens", "3", "Hello")
    assert status == 0, errors
    assert "clover.engine.loops.exact" in modules or "clover.engine.loops.block_loop" in modules  # it decoded here
    heavy = [h for h in NOT_FOR_GENERATE if any(m == h or m.startswith(h + ".") for m in modules)]
    assert not heavy, f"clover generate imported {heavy}"
