"""`clover serve --engine vllm` without starting vLLM: the command line it runs, and its clear refusals."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from model_helpers import tiny_model

from clover.serving.vllm.launch import SERVER_MODULE, vllm_serve_argv

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("launch") / "tiny-dense"
    tiny_model("clover-tiny-dense", head_dim=32).save_pretrained(directory)
    return directory


def _serve(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clover.cli.main", "serve", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_the_command_passes_options_and_vllms_own_flags(checkpoint, monkeypatch) -> None:
    monkeypatch.setenv("CLOVER_VLLM_PYTHON", sys.executable)
    args = argparse.Namespace(host="127.0.0.1", port=8123, max_num_seqs=8, max_model_len=2048, dtype="float32",
                              engine_args=["--tensor-parallel-size", "2", "--enable-expert-parallel"])
    argv = vllm_serve_argv(checkpoint, ["clover-test", "alias"], args)
    assert argv[:5] == [sys.executable, "-m", SERVER_MODULE, "--model", str(checkpoint)]
    joined = " ".join(argv)
    for part in ("--port 8123", "--served-model-name clover-test alias", "--max-num-seqs 8", "--max-model-len 2048",
                 "--dtype float32", "--tool-call-parser hermes"):
        assert part in joined
    assert argv[-3:] == ["--tensor-parallel-size", "2", "--enable-expert-parallel"]
    args.engine_args = ["--tool-call-parser", "pythonic"]  # the user's parser, not hermes
    assert "hermes" not in vllm_serve_argv(checkpoint, ["clover-test"], args)


def test_a_missing_environment_says_how_to_make_it(checkpoint, tmp_path) -> None:
    out = _serve("--engine", "vllm", "--model", str(checkpoint), env={"CLOVER_VLLM_PYTHON": str(tmp_path / "no")})
    assert out.returncode == 2 and "run scripts/setup_vllm.sh" in out.stderr


def test_a_checkpoint_without_causal_path_is_refused_before_vllm_starts(checkpoint, tmp_path) -> None:
    model = tiny_model("clover-tiny-dense", head_dim=32)
    model.config = dataclasses.replace(model.config, token_shift=False, family="sdar")
    model.save_pretrained(tmp_path / "sdar")
    out = _serve("--engine", "vllm", "--model", str(tmp_path / "sdar"), env={"CLOVER_VLLM_PYTHON": sys.executable})
    assert out.returncode == 2 and "no causal (autoregressive) path" in out.stderr


def test_vllm_flags_without_the_vllm_engine_are_an_error(checkpoint) -> None:
    out = _serve("--model", str(checkpoint), "--", "--tensor-parallel-size", "2")
    assert out.returncode == 2 and "add --engine vllm" in out.stderr
