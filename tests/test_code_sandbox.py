"""The benchmarks' sandboxed executor for model-written code (benchmarks/code_sandbox.py) and the HumanEval
programs it runs: a correct solution passes, a wrong one fails, a loop is timed out, and the sandbox holds."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from script_helpers import ROOT, load_script



@pytest.fixture(scope="module")
def sandbox():
    return load_script(ROOT / "benchmarks" / "code_sandbox.py", "code_sandbox")


PROBLEM = {
    "task_id": "Test/0",
    "prompt": "from typing import List\n\n\ndef _twice(x: int) -> int:\n    return 2 * x\n\n\n"
              "def double_all(xs: List[int]) -> List[int]:\n    \"\"\"Double every number.\"\"\"\n",
    "entry_point": "double_all",
    "test": "def check(candidate):\n    assert candidate([1, 2]) == [2, 4]\n    assert candidate([]) == []\n",
}


def test_a_whole_function_in_a_code_block_passes_using_the_prompts_imports_and_helpers(sandbox):
    answer = ("Here it is:\n```python\ndef double_all(xs: List[int]) -> List[int]:\n"
              "    return [_twice(x) for x in xs]\n```\nDone.")
    program = sandbox.humaneval_program(PROBLEM, answer)
    assert program.count("def double_all") == 1 and "def _twice" in program
    assert sandbox.run_python(program).passed


def test_a_bare_body_continues_the_prompt(sandbox):
    assert sandbox.run_python(sandbox.humaneval_program(PROBLEM, "    return [2 * x for x in xs]\n")).passed


def test_a_wrong_solution_fails_with_the_assertion(sandbox):
    result = sandbox.run_python(sandbox.humaneval_program(PROBLEM, "```python\ndef double_all(xs):\n"
                                                                   "    return xs\n```"))
    assert result.status == "failed" and "AssertionError" in result.detail


def test_a_syntax_error_fails(sandbox):
    assert sandbox.run_python(sandbox.humaneval_program(PROBLEM, "```python\ndef double_all(xs)\n```")).status \
        == "failed"


def test_an_infinite_loop_is_timed_out(sandbox):
    t0 = time.perf_counter()
    result = sandbox.run_python("while True:\n    pass\n", timeout_s=1.0)
    assert result.status == "timed out"
    assert time.perf_counter() - t0 < 10


def test_endless_output_is_cut_off(sandbox):
    assert sandbox.run_python("while True:\n    print('x' * 1000)\n", timeout_s=1.0).status == "timed out"
    # stderr is kept only up to the file-size limit: writing past it ends the program
    assert sandbox.run_python("import sys\nwhile True:\n    sys.stderr.write('x' * 100000)\n",
                              timeout_s=5.0).status == "failed"


def test_the_sandbox_limits_memory_and_refuses_network_and_processes(sandbox, tmp_path):
    assert sandbox.run_python("x = bytearray(2 << 30)\n", memory_mb=256).status == "failed"
    net = sandbox.run_python("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\n")
    assert net.status == "failed" and ("Error" in net.detail)
    assert sandbox.run_python("import os\nos.system('true')\n").status == "failed"
    # it runs in an empty temporary directory: relative writes land there, not in the caller's directory
    assert sandbox.run_python("import os\nassert os.listdir('.') == []\nopen('x.txt', 'w').write('x')\n").passed
    assert not Path("x.txt").exists()


def test_bad_limits_are_refused(sandbox):
    with pytest.raises(ValueError, match="timeout_s"):
        sandbox.run_python("pass", timeout_s=0)
